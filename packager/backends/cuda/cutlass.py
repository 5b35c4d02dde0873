"""NVIDIA's CUTLASS on the Jetson GPU path: convolutions as implicit GEMM on the tensor cores (#42).

CUTLASS 4.1.0 ships inside the ``apache-tvm`` wheel (``tvm/3rdparty/cutlass/include``); nothing is downloaded.
A convolution becomes one CUTLASS Sm80 kernel (``DefaultConv2dFpropWithBroadcast``: NHWC activations, OHWI
weights, ``mma.sync`` through ``ldmatrix`` and ``cp.async``) with its epilogue fused. fp16: f16 x f16 with fp32
accumulation, ``act(conv + residual + bias)``, the bias broadcast per output channel. int8: s8 x s8 -> s32 and
edgeq's ``Requantize`` epilogue (int32 bias, per-channel scale and shift, a dequantized int8 residual, the
activation, rounding and saturation to int8; or a float32 output where no quantize follows). Sm80 templates use
only Ampere instructions, so the same source runs on the Orin (sm_87) and on Hopper (sm_90); it has run on an
H200 (benchmarks/RESULTS.md).

How it reaches a TVM module:
- each layer is a scheduled TIR PrimFunc (``prim_func``) whose one statement calls an ``extern "C" __device__``
  wrapper (``device_source``) with the raw pointers and the block's dynamic shared memory (allocated inside the
  thread bindings: outside them TVM would pass a global buffer in), as large as the kernel's ``SharedStorage``
  and ``Params``; TVM launches it with the kernel's grid and block (its CUDA runtime opts in to more than 48 KiB
  of dynamic shared memory itself);
- the wrapper builds CUTLASS's ``Params`` on the device from the problem's constants (shapes are static in a
  bundle) and runs the kernel's ``operator()``;
- ``tvm_callback_cuda_postproc`` (``wrappers_in_module``) puts the wrappers in front of the module's CUDA
  source, and NVRTC (the edgeq toolkit, ``TVM_CUDA_NVRTC_EXTRA_OPTS``) gets CUTLASS's include folder.

``prepare_nhwc`` makes the graph NHWC and pads channels, ``find_convs`` finds the chains a kernel can take and
``claim_convs`` puts the kernels' calls in their place. ``replay``/``replay_int8`` are the independent host
implementations (numpy) of what a kernel is asked to compute, ``twin_prim_func`` a plain TIR one the rewritten
graph runs with on the host. Depthwise convolutions get edgeq's own TIR kernel (``DepthwiseKernel``) with the same
epilogue. A transformer's Q, K and V projections are one GEMM (``_projections_as_one``) whose output the attention
GEMMs read in place; its layer norms are edgeq's kernel (``layer_norm.py``). Not here yet: split-K.
docs/architecture.md says where this stands.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import functools
import math
import os
import re
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from edgeq.backends.cuda.cubin import elf_symbol_sizes
from edgeq.backends.cuda.device_math import EXP_RN_CPP, silu_rn_numpy, silu_rn_tir

ACTIVATIONS = {  # name -> CUTLASS elementwise functor on float (edgeq's own where CUTLASS has none)
    "identity": "cutlass::epilogue::thread::Identity<float>",
    "relu": "cutlass::epilogue::thread::ReLu<float>",
    "relu6": "edgeq_cutlass::Relu6",
    "silu": "cutlass::epilogue::thread::SiLu<float>",
    "hardswish": "cutlass::epilogue::thread::HardSwish<float>",
    "gelu": "cutlass::epilogue::thread::GELU<float>",
}
ALIGNMENT = 8  # fp16 elements per 128-bit access: channels are padded to a multiple of it
ALIGNMENT_INT8 = 16  # int8 elements per 128-bit access


def alignment(dtype: str) -> int:
    """Input channels a convolution of ``dtype`` activations is padded to a multiple of."""
    return ALIGNMENT_INT8 if dtype == "int8" else ALIGNMENT
PREAMBLE = r"""
#include <cuda/std/type_traits>
namespace std { using cuda::std::void_t; }  // NVRTC: CUTLASS's bias-elementwise epilogue names std::void_t
#include <cutlass/cutlass.h>
#include <cutlass/conv/kernel/default_conv2d_fprop_with_broadcast.h>
#include <cutlass/conv/kernel/default_conv2d_group_fprop.h>
#include <cutlass/epilogue/thread/linear_combination_generic.h>
#include <cutlass/epilogue/thread/activation.h>
#include <cutlass/epilogue/thread/linear_combination_bias_elementwise.h>
#include <cutlass/epilogue/thread/linear_combination.h>
#include <cutlass/gemm/kernel/default_gemm.h>
#include <cutlass/gemm/kernel/gemm_batched.h>
namespace edgeq_cutlass {
""" + EXP_RN_CPP + r"""
struct Relu6 {
  CUTLASS_HOST_DEVICE float operator()(float x) const { return x < 0.f ? 0.f : (x > 6.f ? 6.f : x); }
};
template <typename T>  // for LinearCombinationGeneric, which takes the activation as a template of its fragment
struct Relu6T {
  CUTLASS_HOST_DEVICE T operator()(T x) const { return Relu6()(x); }
};
template <typename T, int N>
struct Relu6T<cutlass::Array<T, N>> {
  CUTLASS_HOST_DEVICE cutlass::Array<T, N> operator()(cutlass::Array<T, N> const& v) const {
    cutlass::Array<T, N> out;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) out[i] = Relu6()(v[i]);
    return out;
  }
};

// The int8 epilogue (edgeq's: CUTLASS 2.x's convolution epilogues broadcast one per-channel vector, and a
// requantization needs three, the int32 bias, the float scale and shift). DefaultConv2dFpropWithBroadcast hands
// it each output element's channel index as its broadcast vector; it reads those channels' constants itself:
//   v = float(acc + bias[k]) * scale[k] + shift[k];  [v = v * sigmoid(v)]  (SiLU, through edgeq's exp_rn)
//   v = clamp(v  [+ float(residual) * residual_scale], act_lo, act_hi)
//   [v = v * post[k]]  (a per-channel multiplier: the next depthwise layer's input channel scale)
//   v = v / out_div
//   y = int8(clamp(round half to even(v), lo, hi))
// Each step rounds as the graph's float32 operators do (no contraction into FMA), so it computes what the
// requantize chain it replaces computes.
struct RequantParams {
  int32_t const* bias; float const* scale; float const* shift; float residual_scale; float act_lo; float act_hi;
  float out_div; float lo; float hi; int residual; int silu; float const* post;
};
// Res: the residual's type where it is not the output's (an int8 output with the float32 residual of another int8
// layer whose output is float, a ResNet's downsampling shortcut; a float output with an int8 residual, the last
// block before a global pool). The epilogue's source C (and its unused Z) then has the residual's type and the
// output goes out through the epilogue's second output, T (Out, row stride ldt).
template <int N, typename Out = int8_t, typename Res = Out>
class Requantize {  // Out float: the value before the division, unrounded (an int8 layer whose output is float)
 public:
  static bool const kSame = cutlass::platform::is_same<Out, Res>::value;
  using ElementOutput = Res; using ElementD = Res; using ElementC = Res;
  using ElementAccumulator = int32_t; using ElementCompute = float; using ElementScalar = float;
  using ElementZ = Res; using ElementT = Out; using ElementVector = float;
  static int const kElementsPerAccess = N; static int const kCount = N;
  static bool const IsEltActSupported = true; static bool const kIsSingleSource = true;
  using FragmentAccumulator = cutlass::Array<int32_t, N>; using FragmentCompute = cutlass::Array<float, N>;
  using FragmentC = cutlass::Array<Res, N>; using FragmentZ = cutlass::Array<Res, N>;
  using FragmentT = cutlass::Array<Out, N>; using FragmentSource = FragmentC; using FragmentOutput = FragmentZ;
  using ElementBias = float; using FragmentBias = cutlass::Array<float, N>;
  static bool const kIsHeavy = false; static bool const kStoreZ = kSame; static bool const kStoreT = !kSame;
  using Params = RequantParams;
  CUTLASS_HOST_DEVICE Requantize(Params const& p) : p_(p) {}
  CUTLASS_HOST_DEVICE bool is_source_needed() const { return p_.residual != 0; }
  CUTLASS_HOST_DEVICE void set_k_partition(int, int) {}
  // An access is N consecutive output channels from channel[0] (a multiple of N: K is padded to 8): the
  // per-channel constants come in as 16-byte vector loads, once per access
  CUTLASS_DEVICE void operator()(FragmentZ& z, FragmentT& t, FragmentAccumulator const& acc, FragmentC const& c,
                                 FragmentCompute const& channel) const {
    int k0 = int(channel[0]);
    cutlass::Array<Out, N> out;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; i += 4) quad(out, acc, k0, i, &c);
    store(z, t, out);
  }
  CUTLASS_DEVICE void operator()(FragmentZ& z, FragmentT& t, FragmentAccumulator const& acc,
                                 FragmentCompute const& channel) const {
    int k0 = int(channel[0]);
    cutlass::Array<Out, N> out;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; i += 4) quad(out, acc, k0, i, static_cast<FragmentC const*>(nullptr));
    store(z, t, out);
  }

 private:
  CUTLASS_DEVICE void store(FragmentZ& z, FragmentT& t, cutlass::Array<Out, N> const& out) const {
    if constexpr (kSame) {
      z = out;
    } else {
      t = out;
    }
  }
  CUTLASS_DEVICE void quad(cutlass::Array<Out, N>& z, FragmentAccumulator const& acc, int k0, int i,
                           FragmentC const* c) const {
    int4 b = __ldg(reinterpret_cast<int4 const*>(p_.bias + k0 + i));
    float4 s = __ldg(reinterpret_cast<float4 const*>(p_.scale + k0 + i));
    float4 h = __ldg(reinterpret_cast<float4 const*>(p_.shift + k0 + i));
    float4 m = p_.post ? __ldg(reinterpret_cast<float4 const*>(p_.post + k0 + i)) : make_float4(1.f, 1.f, 1.f, 1.f);
    z[i] = one(acc[i] + b.x, s.x, h.x, c ? float((*c)[i]) : 0.f, m.x);
    z[i + 1] = one(acc[i + 1] + b.y, s.y, h.y, c ? float((*c)[i + 1]) : 0.f, m.y);
    z[i + 2] = one(acc[i + 2] + b.z, s.z, h.z, c ? float((*c)[i + 2]) : 0.f, m.z);
    z[i + 3] = one(acc[i + 3] + b.w, s.w, h.w, c ? float((*c)[i + 3]) : 0.f, m.w);
  }
  CUTLASS_DEVICE Out one(int32_t acc_bias, float scale, float shift, float residual, float post) const {
    float x = __fadd_rn(__fmul_rn(float(acc_bias), scale), shift);
    if (p_.silu) x = silu_rn(x);  // edgeq's exp: the twin's and the replay's bits (device_math.py)
    if (p_.residual) x = __fadd_rn(x, __fmul_rn(residual, p_.residual_scale));
    x = fminf(fmaxf(x, p_.act_lo), p_.act_hi);
    if (p_.post) x = __fmul_rn(x, post);
    if constexpr (cutlass::platform::is_same<Out, float>::value) {
      return x;
    } else {
      x = __fdiv_rn(x, p_.out_div);
      return Out(int(fminf(fmaxf(rintf(x), p_.lo), p_.hi)));
    }
  }
  Params p_;
};

// The fp16 epilogue of a residual added after the activation (CUTLASS's bias-elementwise epilogue adds its source
// before it): z = half(act(acc + bias[k]) + float(residual)), the bias the broadcast vector (YOLO's bottleneck,
// x + SiLU(conv(x))).
template <int N, typename Act>
class BiasActResidual {
 public:
  using ElementOutput = cutlass::half_t; using ElementD = cutlass::half_t; using ElementC = cutlass::half_t;
  using ElementAccumulator = float; using ElementCompute = float; using ElementScalar = float;
  using ElementZ = cutlass::half_t; using ElementT = cutlass::half_t; using ElementVector = cutlass::half_t;
  static int const kElementsPerAccess = N; static int const kCount = N;
  static bool const IsEltActSupported = true; static bool const kIsSingleSource = true;
  using FragmentAccumulator = cutlass::Array<float, N>; using FragmentCompute = cutlass::Array<float, N>;
  using FragmentC = cutlass::Array<cutlass::half_t, N>; using FragmentZ = FragmentC; using FragmentT = FragmentC;
  using FragmentSource = FragmentC; using FragmentOutput = FragmentZ;
  using ElementBias = cutlass::half_t; using FragmentBias = cutlass::Array<cutlass::half_t, N>;
  static bool const kIsHeavy = false; static bool const kStoreZ = true; static bool const kStoreT = false;
  struct Params {};
  CUTLASS_HOST_DEVICE BiasActResidual(Params const&) {}
  CUTLASS_HOST_DEVICE bool is_source_needed() const { return true; }
  CUTLASS_HOST_DEVICE void set_k_partition(int, int) {}
  CUTLASS_DEVICE void operator()(FragmentZ& z, FragmentT&, FragmentAccumulator const& acc, FragmentC const& c,
                                 FragmentCompute const& bias) const {
    Act act;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) z[i] = cutlass::half_t(act(acc[i] + bias[i]) + float(c[i]));
  }
  CUTLASS_DEVICE void operator()(FragmentZ& z, FragmentT&, FragmentAccumulator const& acc,
                                 FragmentCompute const& bias) const {
    Act act;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) z[i] = cutlass::half_t(act(acc[i] + bias[i]));
  }
};

// A batched GEMM's epilogue that quantizes its fp16 result to int8 with one scale (attention's context, P V, read
// per tensor by the output projection): y = int8(clamp(round(float(half(acc * alpha)) / divisor), lo, hi)), each
// step rounded as the graph's operators (the fp16 cast, the division, round half to even).
struct HalfQuantizeParams {
  float alpha; float divisor; float lo; float hi;
};
template <int N>
class HalfQuantize {
 public:
  using ElementOutput = int8_t; using ElementC = int8_t; using ElementD = int8_t;
  using ElementAccumulator = float; using ElementCompute = float; using ElementScalar = float;
  static int const kCount = N;
  using FragmentOutput = cutlass::Array<int8_t, N>; using FragmentSource = FragmentOutput;
  using FragmentAccumulator = cutlass::Array<float, N>; using FragmentCompute = cutlass::Array<float, N>;
  using Params = HalfQuantizeParams;
  CUTLASS_HOST_DEVICE HalfQuantize(Params const& p) : p_(p) {}
  CUTLASS_HOST_DEVICE bool is_source_needed() const { return false; }
  CUTLASS_HOST_DEVICE void set_k_partition(int, int) {}
  CUTLASS_DEVICE FragmentOutput operator()(FragmentAccumulator const& acc) const {
    FragmentOutput y;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) {
      float v = __half2float(__float2half_rn(__fmul_rn(acc[i], p_.alpha)));
      y[i] = int8_t(int(fminf(fmaxf(rintf(__fdiv_rn(v, p_.divisor)), p_.lo), p_.hi)));
    }
    return y;
  }
  CUTLASS_DEVICE FragmentOutput operator()(FragmentAccumulator const& acc, FragmentOutput const&) const {
    return (*this)(acc);
  }

 private:
  Params p_;
};

// The part of CUTLASS's PredicatedTileIterator that an epilogue's store-only second output (T) uses: its types, its
// Params (built from the kernel's ldt: T's row stride, in elements), its thread map's walk over the output tile
// (each thread's accesses, row m of the implicit GEMM and first column, the same as the epilogue's own store)
// and its row stepping (operator++). Derived iterators define store() with their own addresses.
template <typename ThreadMap_, typename Element_>
class StoreOnlyIterator {
 public:
  using ThreadMap = ThreadMap_;
  using Shape = typename ThreadMap::Shape;
  using Element = Element_;
  using Layout = cutlass::layout::RowMajor;
  using TensorRef = cutlass::TensorRef<Element, Layout>;
  using ConstTensorRef = typename TensorRef::ConstTensorRef;
  using Index = typename Layout::Index;
  using LongIndex = typename Layout::LongIndex;
  using TensorCoord = cutlass::MatrixCoord;
  static int const kElementsPerAccess = ThreadMap::kElementsPerAccess;
  static int const kThreads = ThreadMap::kThreads;
  using Fragment = cutlass::Array<Element, ThreadMap::Iterations::kColumn * ThreadMap::Iterations::kRow *
                                               ThreadMap::Iterations::kGroup * ThreadMap::Iterations::kCluster *
                                               kElementsPerAccess>;
  using AccessType = cutlass::AlignedArray<Element, kElementsPerAccess>;
  struct Params {
    LongIndex ld;
    CUTLASS_HOST_DEVICE Params() : ld(0) {}
    CUTLASS_HOST_DEVICE Params(LongIndex ld_) : ld(ld_) {}
  };
  CUTLASS_DEVICE StoreOnlyIterator(Params const& params, Element* pointer, TensorCoord extent, int thread_idx,
                                   TensorCoord threadblock_offset = TensorCoord())
      : ld_(params.ld), ptr_(pointer), extent_row_(extent.row()), extent_column_(extent.column()) {
    TensorCoord offset = ThreadMap::initial_offset(thread_idx) + threadblock_offset;
    thread_start_row_ = offset.row();
    thread_start_column_ = offset.column();
    state_[0] = state_[1] = state_[2] = 0;
  }
  CUTLASS_HOST_DEVICE StoreOnlyIterator& operator++() {  // PredicatedTileIterator's row stepping
    ++state_[0];
    thread_start_row_ += ThreadMap::Shape::kRow;
    if (state_[0] == ThreadMap::Count::kRow) {
      state_[0] = 0;
      ++state_[1];
      thread_start_row_ += (ThreadMap::Shape::kGroup - 1) * ThreadMap::Shape::kRow * ThreadMap::Count::kRow;
      if (state_[1] == ThreadMap::Count::kGroup) {
        state_[1] = 0;
        ++state_[2];
        thread_start_row_ += ThreadMap::Count::kGroup * ThreadMap::Shape::kGroup * ThreadMap::Count::kRow *
                             ThreadMap::Shape::kRow;
        if (state_[2] == ThreadMap::Count::kCluster) {
          state_[2] = 0;
          thread_start_row_ += ThreadMap::Shape::kGroup * ThreadMap::Shape::kRow * ThreadMap::Shape::kCluster *
                               ThreadMap::Shape::kTile;
        }
      }
    }
    return *this;
  }

 protected:
  // visit(m, column, access) for each of this thread's accesses in the fragment whose row m is inside the output
  // (its columns are the visitor's to guard: extent_column_)
  template <typename Visit>
  CUTLASS_DEVICE void for_each_access(Fragment const& frag, Visit visit) const {
    if (!ptr_) return;
    AccessType const* frag_ptr = reinterpret_cast<AccessType const*>(&frag);
    CUTLASS_PRAGMA_UNROLL
    for (int cluster = 0; cluster < ThreadMap::Iterations::kCluster; ++cluster) {
      CUTLASS_PRAGMA_UNROLL
      for (int group = 0; group < ThreadMap::Iterations::kGroup; ++group) {
        CUTLASS_PRAGMA_UNROLL
        for (int row = 0; row < ThreadMap::Iterations::kRow; ++row) {
          int frag_row = row + ThreadMap::Iterations::kRow * (group + ThreadMap::Iterations::kGroup * cluster);
          int m = thread_start_row_ + row * ThreadMap::Delta::kRow + group * ThreadMap::Delta::kGroup +
                  cluster * ThreadMap::Delta::kCluster;
          if (m >= extent_row_) continue;
          CUTLASS_PRAGMA_UNROLL
          for (int column = 0; column < ThreadMap::Iterations::kColumn; ++column)
            visit(m, thread_start_column_ + column * ThreadMap::Delta::kColumn,
                  frag_ptr[frag_row * ThreadMap::Iterations::kColumn + column]);
        }
      }
    }
  }
  LongIndex ld_;
  Element* ptr_;
  Index extent_row_, extent_column_, thread_start_row_, thread_start_column_;
  int state_[3];
};

// A convolution's output also written nearest-upsampled 2x (YOLO's neck: the upsampled map is a part of the next
// concatenation): the epilogue's second output, T, through this iterator instead of CUTLASS's PredicatedTileIterator.
// Output row m of the implicit GEMM is pixel (n, p, q) with m = (n P + p) Q + q; its value goes to the four pixels
// (2 (n P + p) + dy) 2Q + 2q + dx (dy, dx in {0, 1}) of the [N, 2P, 2Q, ld] tensor T points into (at its first
// channel); every access is kElementsPerAccess whole channels.
template <typename ThreadMap_, typename Element_, int Q>
class Upsample2xIterator : public StoreOnlyIterator<ThreadMap_, Element_> {
 public:
  using Base = StoreOnlyIterator<ThreadMap_, Element_>;
  using typename Base::AccessType; using typename Base::Element; using typename Base::Fragment;
  using typename Base::LongIndex;
  using Base::Base;
  CUTLASS_DEVICE void store(Fragment const& frag) const {
    Element* ptr = this->ptr_;
    LongIndex ld = this->ld_;
    int columns = this->extent_column_;
    this->for_each_access(frag, [&](int m, int col, AccessType const& v) {
      if (col >= columns) return;
      Element* top = ptr + (LongIndex(m / Q) * (4 * Q) + 2 * (m % Q)) * ld + col;  // pixel (2 (nP + p), 2q)
      CUTLASS_PRAGMA_UNROLL
      for (int d = 0; d < 4; ++d)  // (dy, dx) = (d / 2, d % 2): global stores of the whole access (STG)
        cutlass::arch::global_store<AccessType, sizeof(AccessType)>(
            v, static_cast<void*>(top + ((d / 2) * 2 * Q + d % 2) * ld), true);
    });
  }
};

// A detector head's last convolution writing its part of the model's output directly ([N, C, A]: a level's box or
// class channels at its anchors, the exporter's transpose, reshape and concatenations): output element (m, k), m =
// n HW + pixel, goes to (n C + k) A + pixel from where T points (its first channel and anchor). Channel-major: each
// element of an access is its own store, A apart (a warp's lanes write neighbouring pixels of a channel).
template <typename ThreadMap_, typename Element_, int HW, int C, int A>
class ChannelMajorIterator : public StoreOnlyIterator<ThreadMap_, Element_> {
 public:
  using Base = StoreOnlyIterator<ThreadMap_, Element_>;
  using typename Base::AccessType; using typename Base::Element; using typename Base::Fragment;
  using typename Base::LongIndex;
  using Base::Base;
  CUTLASS_DEVICE void store(Fragment const& frag) const {
    Element* ptr = this->ptr_;
    int columns = this->extent_column_;
    this->for_each_access(frag, [&](int m, int col, AccessType const& v) {
      Element* pixel = ptr + LongIndex(m / HW) * C * A + m % HW;
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < Base::kElementsPerAccess; ++j)
        if (col + j < columns)
          cutlass::arch::global_store<Element, sizeof(Element)>(
              v[j], static_cast<void*>(pixel + LongIndex(col + j) * A), true);
    });
  }
};

// An epilogue functor that hands its output Z out as T too, converted to Out (the epilogue stores T through
// WithT's iterator): an upsampled copy (Out: Z's element, Z stored as well), or a detector head's part of the
// model's output (StoreZ false: only T; the fp16 head's value as the float32 the model outputs, the graph rounding
// to fp16 first, then casting; an int8 head's float as is).
template <typename F, typename Out = typename F::ElementZ, bool StoreZ = true>
struct ZAsT : F {
  using Params = typename F::Params;
  using ElementT = Out;
  using FragmentT = cutlass::Array<Out, F::FragmentZ::kElements>;
  static bool const kStoreZ = StoreZ;
  static bool const kStoreT = true;
  CUTLASS_HOST_DEVICE ZAsT(Params const& p) : F(p) {}
  template <typename... A>
  CUTLASS_DEVICE void operator()(typename F::FragmentZ& z, FragmentT& t, A const&... a) const {
    typename F::FragmentT unused;
    F::operator()(z, unused, a...);
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < F::FragmentZ::kElements; ++i) t[i] = Out(z[i]);
  }
};

// A convolution kernel (DefaultConv2dFpropWithBroadcast's B, its functor a ZAsT) whose T goes out
// through the iterator TIterator<ThreadMap, element> makes.
template <typename B, template <typename, typename> class TIterator>
struct WithT {
  using E = typename B::Epilogue;
  using Epilogue = cutlass::epilogue::threadblock::EpilogueWithBroadcast<
      typename E::Shape, typename E::WarpMmaOperator, E::kPartitionsK, typename E::OutputTileIterator,
      TIterator<typename E::OutputTileIterator::ThreadMap, typename E::OutputOp::ElementT>,
      typename E::ElementVector, typename E::AccumulatorFragmentIterator, typename E::WarpTileIterator,
      typename E::SharedLoadIterator, typename E::OutputOp, typename E::Padding, E::kFragmentsPerIteration>;
  using Kernel = cutlass::conv::kernel::ImplicitGemmConvolutionWithFusedEpilogue<
      typename B::ImplicitGemmBase::Mma, Epilogue, typename B::Kernel::ThreadblockSwizzle,
      cutlass::conv::Operator::kFprop>;
};
template <int Q>
struct Upsample2x {  // WithT's iterator: the output upsampled
  template <typename ThreadMap, typename Element>
  using Iterator = Upsample2xIterator<ThreadMap, Element, Q>;
};
template <int HW, int C, int A>
struct ChannelMajor {  // WithT's iterator: a detector head's output
  template <typename ThreadMap, typename Element>
  using Iterator = ChannelMajorIterator<ThreadMap, Element, HW, C, A>;
};
}  // namespace edgeq_cutlass
"""


def cutlass_include() -> Path:
    """CUTLASS's headers in the installed apache-tvm wheel."""
    import importlib.util

    spec = importlib.util.find_spec("tvm")
    root = Path(spec.origin).parent / "3rdparty" / "cutlass" / "include"
    if not (root / "cutlass" / "version.h").is_file():
        from edgeq.errors import ToolchainError

        raise ToolchainError(f"the apache-tvm wheel here has no CUTLASS headers ({root}); reinstall apache-tvm")
    return root


def cutlass_version() -> str:
    """"4.1.0": CUTLASS_MAJOR.MINOR.PATCH of the wheel's headers (the manifest records it)."""
    text = (cutlass_include() / "cutlass" / "version.h").read_text()
    parts = [re.search(rf"#define CUTLASS_{p}\s+(\d+)", text) for p in ("MAJOR", "MINOR", "PATCH")]
    return ".".join(m.group(1) if m else "?" for m in parts)


@dataclasses.dataclass(frozen=True)
class Conv2dProblem:
    """One 2-D convolution, NHWC in, OHWI weights, NHWC out (CUTLASS's ``Conv2dProblemSize``)."""

    n: int
    h: int
    w: int
    c: int  # input channels, padded to ALIGNMENT
    k: int  # output channels
    r: int
    s: int
    pad: tuple[int, int] = (0, 0)  # top/left (CUTLASS pads bottom/right to what the output size needs)
    stride: tuple[int, int] = (1, 1)
    dilation: tuple[int, int] = (1, 1)
    c_real: int = 0  # the model's input channels before padding (0: c)
    groups: int = 1  # c (= k): a depthwise convolution (``DepthwiseKernel``), weights HWOI [R, S, K, 1]; between 1
    # and c: a grouped convolution (``GroupConvKernel``), weights OHWI [K, R, S, C / groups]

    @property
    def depthwise(self) -> bool:
        return self.groups > 1 and self.groups == self.c

    @property
    def p(self) -> int:
        return (self.h + 2 * self.pad[0] - self.dilation[0] * (self.r - 1) - 1) // self.stride[0] + 1

    @property
    def q(self) -> int:
        return (self.w + 2 * self.pad[1] - self.dilation[1] * (self.s - 1) - 1) // self.stride[1] + 1

    @property
    def gemm(self) -> tuple[int, int, int]:
        """Implicit GEMM (M, N, K): output pixels, output channels, the reduction (per group)."""
        return self.n * self.p * self.q, self.k, self.r * self.s * self.c // self.groups

    @property
    def flops(self) -> int:
        m, n, _ = self.gemm
        return 2 * m * n * self.r * self.s * (self.c_real or self.c) // self.groups


def problem_from_conv(x_shape: Sequence[int], w_shape: Sequence[int], pads: Sequence[int], strides: Sequence[int],
                      dilations: Sequence[int], dtype: str = "float16") -> Conv2dProblem | None:
    """The NHWC problem of an NCHW convolution (ONNX Conv / Relax conv2d attributes: pads top, left, bottom, right);
    None where CUTLASS's kernel cannot take it: groups, asymmetric padding, or fewer than 3 input channels."""
    n, c, h, w = x_shape
    k, c_w, r, s = w_shape
    if c_w != c or len(pads) != 4 or pads[0] != pads[2] or pads[1] != pads[3] or c < 3:
        return None
    align = alignment(dtype)
    padded = c if dtype == "int8" and c % ALIGNMENT == 0 else -(-c // align) * align  # int8: 64-bit loads there
    return Conv2dProblem(n, h, w, padded, k, r, s, (pads[0], pads[1]), tuple(strides), tuple(dilations), c_real=c)


@dataclasses.dataclass(frozen=True)
class Tile:
    """A CUTLASS tile: threadblock and warp shapes (M, N, K), the software pipeline's stages, and the K slices
    (``split_k``: serial split-K, CTAs along K taking turns on their output tile, ``split_k_slices``)."""

    block: tuple[int, int, int]
    warp: tuple[int, int, int]
    stages: int
    split_k: int = 1

    @property
    def threads(self) -> int:
        return (self.block[0] // self.warp[0]) * (self.block[1] // self.warp[1]) * 32

    def mainloop_bytes(self, element_bytes: int = 2) -> int:
        """Shared memory of the multistage mainloop: ``stages`` tiles of A and B (the epilogue's shares it)."""
        return self.stages * (self.block[0] + self.block[1]) * self.block[2] * element_bytes


# (threadblock, warp) shapes for Sm80 tensor-op convolutions, largest first; CUTLASS's own profiler set (int8:
# K of 64, as its IMMA.16832 takes 32 elements of K per instruction)
TILES = (((128, 128, 32), (64, 64, 32)), ((128, 64, 32), (64, 32, 32)), ((64, 64, 32), (32, 32, 32)))
TILES_INT8 = (((128, 128, 64), (64, 64, 64)), ((128, 64, 64), (64, 32, 64)), ((64, 64, 64), (32, 32, 64)))


def choose_tile(problem: Conv2dProblem | GemmProblem, sm_count: int, smem_per_block: int, precision: str = "fp16") -> Tile:
    """The tile table: the largest threadblock tile whose CTAs still fill every SM once (a wave), else the
    smallest; then the most stages (up to 4) whose mainloop fits the profile's shared memory per block."""
    m, n, _ = problem.gemm
    tiles = TILES_INT8 if precision == "int8" else TILES
    fitting = [t for t in tiles if t[0][1] <= max(64, -(-n // 64) * 64)] or list(tiles)  # no tile wider than N
    chosen = fitting[-1]
    for block, warp in fitting:
        ctas = -(-m // block[0]) * -(-n // block[1]) * getattr(problem, "batch", 1)
        if ctas >= sm_count:
            chosen = (block, warp)
            break
    stages = 4
    element = 1 if precision == "int8" else 2
    while stages > 2 and Tile(chosen[0], chosen[1], stages).mainloop_bytes(element) > smem_per_block:
        stages -= 1
    return Tile(chosen[0], chosen[1], stages)


MAX_SPLIT_K = 4
MIN_K_ITERATIONS = 8  # main-loop iterations a slice keeps (a few more than the deepest pipeline's stages)


def split_k(problem: Conv2dProblem, tile: Tile, sm_count: int) -> Tile:
    """``tile`` with its K split into slices (serial split-K: ``ImplicitGemmConvolutionWithFusedEpilogue``'s
    ``SplitKMode::kSerial``) where its output tiles are too few for the GPU: up to ``MAX_SPLIT_K`` slices while the
    CTAs stay within 4 a SM and each slice keeps ``MIN_K_ITERATIONS`` main-loop iterations. The late layers of a
    CNN at batch 1 (7x7 maps, K = 9 x 512) and a transformer's narrow, deep GEMMs (K = 1536 into 384 columns) have
    fewer output tiles than an Orin has SMs times the CTAs each holds. A slice's partial sum goes through the output
    (the next slice adds to it: fp16 outputs round it to fp16, float32 ones keep it), so only kernels whose output
    holds a partial sum take it (``ConvKernel.split_k_allowed``). Channels a multiple of the tile's K."""
    m, n, _ = problem.gemm
    ctas = -(-m // tile.block[0]) * -(-n // tile.block[1])
    bk = tile.block[2]
    if problem.c % bk or problem.groups != 1:
        return tile
    slices = 1
    for candidate in range(2, MAX_SPLIT_K + 1):
        channels = -(-problem.c // candidate)  # a slice's (CUTLASS's implicit_gemm_k_iterations)
        iterations = problem.r * problem.s * -(-channels // bk)
        if ctas * candidate > 4 * sm_count or iterations < MIN_K_ITERATIONS:
            break
        slices = candidate
    return dataclasses.replace(tile, split_k=slices) if slices > 1 else tile


@dataclasses.dataclass(frozen=True)
class ConvKernel:
    """What edgeq asks one CUTLASS convolution to compute. fp16: ``act(conv(x, w) + residual + bias)``. int8 (s8 x s8
    -> s32, the ``Requantize`` epilogue): ``clamp(round((silu?(float(conv + bias) * scale + shift) [+ residual x
    residual_scale]) clamped to [act_lo, act_hi] [x post]) / out_div), lo, hi)`` to int8, ``bias`` int32 and ``scale`` float32
    per output channel."""

    name: str  # a C identifier, unique in its module (the TVM function is cutlass_<name>)
    problem: Conv2dProblem
    tile: Tile
    activation: str = "identity"  # int8: what [act_lo, act_hi] is (identity, relu, relu6 or clip), for people
    residual: bool = False
    precision: str = "fp16"
    residual_scale: float = 0.0  # int8: the epilogue's constants
    act_lo: float = -math.inf  # the activation as a clamp before the division
    act_hi: float = math.inf
    out_div: float = 1.0
    lo: float = -128.0  # the clamp after rounding
    hi: float = 127.0
    float_out: bool = False  # float32 output. int8: the value before the division (no quantize follows); fp16: the
    # epilogue's value unrounded (the graph casts the layer's output to float32: a classifier's logits)
    silu: bool = False  # int8: v * sigmoid(v) right after the scale and shift (before the residual and clamps)
    post: bool = False  # int8: v * post[k] (a per-channel float32 operand) after the clamps, before the division
    # x read in place from a wider tensor (a channel slice: one part of a split, ``pipeline.splits_as_slices``):
    # (first channel, channels of the tensor); the problem's C is the slice's
    x_view: tuple[int, int] | None = None
    # int8: the residual's dtype where it is not the output's ("float32": another int8 layer's float output, a
    # downsampling shortcut's; "int8" into a float output); "": the output's
    residual_dtype: str = ""
    # fp16: the residual added after the activation, ``act(conv + bias) + residual`` (YOLO's bottleneck,
    # ``x + SiLU(conv(x))``; edgeq's ``BiasActResidual`` epilogue), not before it
    residual_after: bool = False
    # fp16: the bias float32 (an fp16 layer of an int8 graph, ``quantize_ops``: its product float32 out, the graph's
    # float32 bias and residual stream after it), the epilogue's broadcast vector in float
    float_bias: bool = False
    # y written in place into a wider tensor (a channel slice of a concatenation, ``concat_in_place``): (first
    # channel, channels of the tensor); the problem's K is the slice's. ``out_in_place``: the tensor comes in as the
    # y operand, already holding other parts (``call_tir_inplace``); else the call allocates it
    out_view: tuple[int, int] | None = None
    out_in_place: bool = False
    residual_view: tuple[int, int] | None = None  # the residual read in place from a wider tensor, as x_view
    # y also written nearest-upsampled 2x into channels [first, first + K) of an [N, 2P, 2Q, channels] tensor that
    # comes in (``call_tir_inplace``: a concatenation's part, YOLO's neck; ``Upsample2xIterator``): (first,
    # channels)
    up_view: tuple[int, int] | None = None
    # y is a detector's output [N, channels, anchors] (the exporter's NCHW transpose, flattening and concatenations):
    # the kernel writes channels [first, first + K) at anchors [anchor, anchor + P Q) (``ChannelMajorIterator``), in
    # ``dtype``: (first, anchor, channels, anchors, dtype)
    head_out: tuple[int, int, int, int, str] | None = None

    @property
    def residual_type(self) -> str:
        """The residual operand's dtype."""
        return self.residual_dtype or self.output_dtype

    @property
    def output_dtype(self) -> str:
        if self.float_out:
            return "float32"
        return "int8" if self.precision == "int8" else "float16"

    @property
    def bias_dtype(self) -> str:
        """int8: int32; fp16: float16, or float32 where the graph adds it in float32 (``float_bias``)."""
        if self.precision == "int8":
            return "int32"
        return "float32" if self.float_bias else "float16"

    @property
    def x_channels(self) -> int:
        """Channels of the tensor x is read from."""
        return self.x_view[1] if self.x_view else self.problem.c

    @property
    def function(self) -> str:
        """The name of its TVM function (and, with ``_kernel``, of its CUDA kernel)."""
        return f"cutlass_{self.name}"

    @property
    def threads(self) -> int:
        return self.tile.threads

    def __post_init__(self):
        if self.tile is not None and self.tile.split_k > 1 and not self.split_k_allowed:
            raise ValueError(f"{self.name}: split-K needs an fp16 kernel whose output holds a partial sum")

    @property
    def split_k_allowed(self) -> bool:
        """Whether serial split-K computes this kernel: an fp16 CUTLASS convolution on CUTLASS's bias-elementwise
        epilogue (which adds a slice's partial sum from the output, and the bias and activation in the last slice
        only) writing every output it makes as Z (no detector output, which only T holds)."""
        return (type(self) is ConvKernel and self.precision != "int8" and not self.residual_after
                and not self.head_out)

    @property
    def grid(self) -> tuple[int, ...]:
        """(CTAs along M, CTAs along N[, K slices]): GemmIdentityThreadblockSwizzle<1>."""
        m, n, _ = self.problem.gemm
        tiles = -(-m // self.tile.block[0]), -(-n // self.tile.block[1])
        return (*tiles, self.tile.split_k) if self.tile.split_k > 1 else tiles

    @property
    def input_alignment(self) -> int:
        """Elements per global load of x and w: 16 (128 bits) for int8, 8 (64 bits) where the input channels are a
        multiple of 8 and not of 16 (24, 40, 56 ...: no pad kernel before the layer)."""
        if self.precision != "int8":
            return ALIGNMENT
        channels = (self.problem.c, *(self.x_view or ()))
        return ALIGNMENT_INT8 if all(c % ALIGNMENT_INT8 == 0 for c in channels) else ALIGNMENT

    @property
    def int8_lanes(self) -> int:
        """Output channels one access of the int8 epilogue (``Requantize<N>``) takes: 16, so that an int8 residual is
        read and an int8 output written 128 bits at a time (#63: the H200's int8 kernels with a residual, at 8, took
        3.5x the time of those without), where K and every channel offset and width of the tensors it reads or
        writes in place are multiples of 16 and the warp tile is 64 wide (CUTLASS's epilogue thread map has no row
        iteration for 16-element accesses on the 32-wide warps of the smaller tiles: a static assertion, measured);
        else 8; 4 (16 bytes of floats) where the output or the residual is float32."""
        if "float32" in (self.output_dtype, self.residual_type):
            return 4
        channels = (self.problem.k, *(self.out_view or ()), *(self.residual_view or ()), *(self.up_view or ()))
        wide = self.tile is not None and self.tile.warp[1] >= 64
        return 16 if wide and all(c % 16 == 0 for c in channels) else 8

    @property
    def out_channels(self) -> int:
        """Channels of the tensor y is written into."""
        return self.out_view[1] if self.out_view else self.problem.k

    @property
    def kernel_type(self) -> str:
        if self.up_view:
            iterator = f"edgeq_cutlass::Upsample2x<{self.problem.q}>::Iterator"
        elif self.head_out:
            iterator = (f"edgeq_cutlass::ChannelMajor<{self.problem.p * self.problem.q}, {self.head_out[2]}, "
                        f"{self.head_out[3]}>::Iterator")
        else:
            return f"typename {self._conv_type}::Kernel"
        return f"typename edgeq_cutlass::WithT<{self._conv_type}, {iterator}>::Kernel"

    @property
    def _conv_type(self) -> str:
        (bm, bn, bk), (wm, wn, wk) = self.tile.block, self.tile.warp

        def op(functor: str) -> str:  # an upsampled copy: the functor's output also as T; a head's: only as T
            if self.head_out:
                return f"edgeq_cutlass::ZAsT<{functor}, {C_TYPES[self.head_out[4]]}, false>"
            return f"edgeq_cutlass::ZAsT<{functor}>" if self.up_view else functor

        if self.precision == "int8":
            out, res = C_TYPES[self.output_dtype], C_TYPES[self.residual_type]
            lanes = self.int8_lanes
            return (
                "cutlass::conv::kernel::DefaultConv2dFpropWithBroadcast<"
                "int8_t, cutlass::layout::TensorNHWC, int8_t, cutlass::layout::TensorNHWC, "
                f"{res}, cutlass::layout::TensorNHWC, int32_t, cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80, "
                f"cutlass::gemm::GemmShape<{bm}, {bn}, {bk}>, cutlass::gemm::GemmShape<{wm}, {wn}, {wk}>, "
                f"cutlass::gemm::GemmShape<16, 8, 32>, {op(f'edgeq_cutlass::Requantize<{lanes}, {out}, {res}>')}, "
                f"cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<1>, {self.tile.stages}, "
                "cutlass::arch::OpMultiplyAddSaturate, cutlass::conv::IteratorAlgorithm::kOptimized, "
                f"cutlass::conv::StrideSupport::kStrided, {self.input_alignment}, {self.input_alignment}>"
            )
        out, lanes = ("float", 4) if self.float_out else ("cutlass::half_t", ALIGNMENT)  # 16-byte stores
        bias = "float" if self.bias_dtype == "float32" else "cutlass::half_t"
        epilogue = (f"edgeq_cutlass::BiasActResidual<{lanes}, {ACTIVATIONS[self.activation]}>" if self.residual_after
                    else f"cutlass::epilogue::thread::LinearCombinationBiasElementwise<{out}, float, float, {out}, "
                    f"{out}, {lanes}, {ACTIVATIONS[self.activation]}, cutlass::plus<float>, false, {bias}>")
        return (
            "cutlass::conv::kernel::DefaultConv2dFpropWithBroadcast<"
            "cutlass::half_t, cutlass::layout::TensorNHWC, cutlass::half_t, cutlass::layout::TensorNHWC, "
            f"{out}, cutlass::layout::TensorNHWC, float, cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80, "
            f"cutlass::gemm::GemmShape<{bm}, {bn}, {bk}>, cutlass::gemm::GemmShape<{wm}, {wn}, {wk}>, "
            f"cutlass::gemm::GemmShape<16, 8, 16>, {op(epilogue)}, "
            f"cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<1>, {self.tile.stages}, "
            "cutlass::arch::OpMultiplyAdd, cutlass::conv::IteratorAlgorithm::kOptimized, "
            "cutlass::conv::StrideSupport::kStrided>"
        )


DEPTHWISE_LANES = 8  # channels per thread: one 16-byte load of fp16 (int8: two 4-byte loads)
DEPTHWISE_THREADS = 128


@dataclasses.dataclass(frozen=True)
class DepthwiseKernel(ConvKernel):
    """A depthwise convolution (groups = channels, one filter per channel; weights HWOI [R, S, K, 1]) with the same
    fused epilogue as ``ConvKernel`` (fp16: bias, activation, residual; int8: the requantization), on edgeq's own
    kernel, not CUTLASS's: ``twin_prim_func``'s TIR scheduled by ``depthwise_prim_func`` (one thread computes 8
    consecutive channels of one output pixel with fp32 / int32 accumulators, 16-byte loads of the input and the
    weights, the zero padding as a predicate). Why not CUTLASS: its depthwise kernels are SIMT as well (no tensor
    core takes a per-channel reduction of R x S), and its epilogue interface hands the output functor no channel
    index, which edgeq's int8 requantization needs for its three per-channel vectors; one kernel for both
    precisions keeps one epilogue. A depthwise layer moves its input and output once and computes little: it is
    memory-bound, and the loads are what the schedule is for."""

    tile: Tile | None = None

    @property
    def function(self) -> str:
        return f"depthwise_{self.name}"

    @property
    def threads(self) -> int:
        return DEPTHWISE_THREADS

    @property
    def grid(self) -> tuple[int, int]:
        p = self.problem
        return -(-(p.n * p.p * p.q * p.k // DEPTHWISE_LANES) // DEPTHWISE_THREADS), 1

    @property
    def kernel_type(self) -> str:
        raise TypeError("a depthwise kernel is TIR, not a CUTLASS template")


ACTIVATION_TEMPLATES = {  # name -> the activation as LinearCombinationGeneric takes it (a template on the type)
    "identity": "cutlass::epilogue::thread::Identity",
    "relu": "cutlass::epilogue::thread::ReLu",
    "relu6": "edgeq_cutlass::Relu6T",
    "silu": "cutlass::epilogue::thread::SiLu",
    "hardswish": "cutlass::epilogue::thread::HardSwish",
    "gelu": "cutlass::epilogue::thread::GELU",
}


@dataclasses.dataclass(frozen=True)
class GroupConvKernel(ConvKernel):
    """A grouped convolution (1 < groups < channels: RegNet's and ResNeXt's 3x3s), fp16: CUTLASS's
    ``DefaultConv2dGroupFprop`` (Sm80 tensor cores, analytic iterators; weights OHWI [K, R, S, C / groups]) with
    ``act(conv + bias)``. One CTA computes one group's tile of output channels (``kSingleGroup``: K / groups a
    multiple of the tile's N) or several whole groups (``kMultipleGroup``: the tile's N a multiple of K / groups;
    CUTLASS's filter iterator zeroes the weights of the other groups). Its epilogue is CUTLASS's standard one,
    which has no broadcast vector: the bias comes in as the source C read with a row stride of 0 (every output pixel
    reads the same K values), which leaves no room for a residual (none of those models adds one there) and none
    for edgeq's int8 requantization (int8 grouped convolutions stay on dlight)."""

    @property
    def channels_per_group(self) -> int:
        return self.problem.c // self.problem.groups

    @property
    def group_mode(self) -> str:
        kg = self.problem.k // self.problem.groups
        return "kSingleGroup" if kg % self.tile.block[1] == 0 else "kMultipleGroup"

    @property
    def work(self) -> float:
        """The tensor cores' work over the useful work: a tile's K of 32 over a group's channels, times the groups
        a CTA computes with the other groups' weights zero (``kMultipleGroup``)."""
        cg, kg, (_, bn, bk) = self.channels_per_group, self.problem.k // self.problem.groups, self.tile.block
        groups_per_cta = bn // kg if self.group_mode == "kMultipleGroup" else 1
        return groups_per_cta * (-(-cg // bk) * bk) / cg

    @property
    def input_alignment(self) -> int:
        """Elements per load of x and w: the largest of 8, 4, 2 dividing the channels of a group."""
        return next(a for a in (8, 4, 2) if self.channels_per_group % a == 0)

    @property
    def kernel_type(self) -> str:
        (bm, bn, bk), (wm, wn, wk) = self.tile.block, self.tile.warp
        a = self.input_alignment
        return (
            "typename cutlass::conv::kernel::DefaultConv2dGroupFprop<"
            "cutlass::half_t, cutlass::layout::TensorNHWC, cutlass::half_t, cutlass::layout::TensorNHWC, "
            "cutlass::half_t, cutlass::layout::TensorNHWC, float, cutlass::arch::OpClassTensorOp, cutlass::arch::Sm80, "
            f"cutlass::gemm::GemmShape<{bm}, {bn}, {bk}>, cutlass::gemm::GemmShape<{wm}, {wn}, {wk}>, "
            "cutlass::gemm::GemmShape<16, 8, 16>, "
            f"cutlass::epilogue::thread::LinearCombinationGeneric<{ACTIVATION_TEMPLATES[self.activation]}, "
            f"cutlass::half_t, {ALIGNMENT}, float, float>, "
            f"cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<1>, {self.tile.stages}, "
            f"cutlass::arch::OpMultiplyAdd, cutlass::conv::GroupMode::{self.group_mode}, "
            f"cutlass::conv::IteratorAlgorithm::kAnalytic, cutlass::conv::StrideSupport::kStrided, {a}, {a}>::Kernel"
        )


def group_tile(problem: Conv2dProblem, sm_count: int, smem_per_block: int) -> Tile | None:
    """``choose_tile`` among the tiles a grouped convolution can take: N a multiple of K / groups (several groups a
    CTA) or K / groups a multiple of N (one); None where no tile fits. Several groups a CTA multiply the tensor
    core's work by the groups in a tile (the other groups' weights are zeros), so the narrowest such tile."""
    kg = problem.k // problem.groups
    fits = [t for t in TILES if kg % t[0][1] == 0] or [t for t in GROUP_TILES if t[0][1] % kg == 0][-1:]
    if not fits:
        return None
    tile = choose_tile(problem, sm_count, smem_per_block)
    if (tile.block, tile.warp) in fits:
        return tile
    stages = 4
    while stages > 2 and Tile(*fits[-1], stages).mainloop_bytes() > smem_per_block:
        stages -= 1
    return Tile(*fits[-1], stages)


@dataclasses.dataclass(frozen=True)
class TokenLinearKernel(ConvKernel):
    """An int8 linear layer with per-token activation scales (a transformer's: the row scale of its input is
    computed at run time) as one CUTLASS GEMM: s8 x s8 -> s32 over x [M, C] (the tokens of the 1x1 convolution
    ``_matmul_as_conv`` made of the layer) and w [N, C] (OHWI), ``DefaultGemmWithVisitor``'s Sm80 mainloop, and an
    epilogue visitor tree (CUTLASS's ``Sm80EVT``: the output channel's weight scale and bias broadcast along the
    rows, the token's scale along the columns, one edgeq functor computing)
    ``y = float(acc) * scale[n] * token[m] + bias[n]``, then [the GELU of the graph's erf form, with its constants]
    or [+ residual, float32], out as float32 or fp16 (``out_dtype``). CUTLASS 2.x's convolution epilogues broadcast
    one vector along the rows only, which is why the conv kernels stop at the weight scale and leave the rest to a
    kernel of their own. Each step rounds as the graph's float32 operators do (``__fmul_rn``, ``__fadd_rn``: no
    contraction into FMA); erff is CUDA's (the host's erf may differ in the last place)."""

    out_dtype: str = "float32"
    # GELU as the graph writes it: (its scaling constant, True where x is divided by it (x / sqrt(2)) rather than
    # multiplied (x * 1/sqrt(2)), the half, the one, True where the half multiplies x first ((x * 0.5) * (1 + erf))
    gelu: tuple[float, bool, float, float, bool] | None = None

    @property
    def output_dtype(self) -> str:
        return self.out_dtype

    @property
    def residual_type(self) -> str:
        return "float32"

    @property
    def rows(self) -> int:
        p = self.problem
        return p.n * p.p * p.q

    @property
    def kernel_type(self) -> str:
        (bm, bn, bk), (wm, wn, wk) = self.tile.block, self.tile.warp
        out = "cutlass::half_t" if self.out_dtype == "float16" else "float"
        return (
            "typename cutlass::gemm::kernel::DefaultGemmWithVisitor<"
            f"int8_t, cutlass::layout::RowMajor, cutlass::ComplexTransform::kNone, {self.input_alignment}, "
            f"int8_t, cutlass::layout::ColumnMajor, cutlass::ComplexTransform::kNone, {self.input_alignment}, "
            f"{out}, cutlass::layout::RowMajor, {self.out_lanes}, int32_t, float, cutlass::arch::OpClassTensorOp, "
            f"cutlass::arch::Sm80, cutlass::gemm::GemmShape<{bm}, {bn}, {bk}>, "
            f"cutlass::gemm::GemmShape<{wm}, {wn}, {wk}>, cutlass::gemm::GemmShape<16, 8, 32>, "
            f"Evt_{token_linear_types(self)[0]}, "
            f"cutlass::gemm::threadblock::GemmIdentityThreadblockSwizzle<1>, {self.tile.stages}, "
            "cutlass::arch::OpMultiplyAddSaturate, 1>::GemmKernel"
        )

    @property
    def out_lanes(self) -> int:  # 16-byte stores
        return ALIGNMENT if self.out_dtype == "float16" else 4


def gemm_tile(tile: Tile, alignment: int) -> Tile:
    """``tile`` for a GEMM whose operands allow accesses of ``alignment`` fp16 elements: cp.async copies 4, 8 or 16
    bytes, so one element (2 bytes) takes CUTLASS's two-stage mainloop (``MmaPipelined``, plain loads)."""
    return dataclasses.replace(tile, stages=2) if alignment * 2 < 4 else tile


GROUP_TILES = TILES + (((64, 32, 32), (32, 32, 32)),)  # several groups a CTA: the narrowest tile wastes least
MAX_GROUP_WORK = 8  # tensor-core work over useful work a grouped kernel may do (beyond it, CUDA cores do better)


@dataclasses.dataclass(frozen=True)
class GemmProblem:
    """A batch of row-major matrix products ``y[b] = a[b] @ w[b]``: a [M, K], w [K, N], y [M, N] per batch, each
    operand contiguous (attention's Q K^T and P V, whose second operand is an activation)."""

    batch: int
    m: int
    n: int
    k: int

    @property
    def gemm(self) -> tuple[int, int, int]:
        return self.m, self.n, self.k

    @property
    def flops(self) -> int:
        return 2 * self.batch * self.m * self.n * self.k


@dataclasses.dataclass(frozen=True)
class GemmKernel:
    """What edgeq asks one CUTLASS batched GEMM to compute: ``fp16((a @ w) * alpha)`` with fp16 operands and fp32
    accumulation (``GemmBatched`` over ``DefaultGemm``'s Sm80 mainloop and epilogue, one batch per blockIdx.z)."""

    name: str
    problem: GemmProblem
    tile: Tile
    alpha: float = 1.0  # a scalar the product is multiplied by before rounding (attention's 1/sqrt(d))
    precision: str = "fp16"
    activation: str = "identity"
    residual: bool = False
    float_out: bool = False
    # Operands read or written in place of a head transpose (``_head_view``): (leading dimension, batch stride) in
    # elements, None where the operand is contiguous. Attention's heads, [1, S, H, D] seen as H matrices [S, D]:
    # (H * D, D). ``b_column_major``: w[b] is read as the transpose of a row-major [N, K] (K^T, from K's heads).
    a_view: tuple[int, int] | None = None
    b_view: tuple[int, int] | None = None
    y_view: tuple[int, int] | None = None
    b_column_major: bool = False
    # where a and w start in the tensors they are read from, in elements: a head view of one part of several
    # projections computed as one (``_projections_as_one``: Q, K and V side by side in one [S, 3 x H x D] tensor)
    a_offset: int = 0
    b_offset: int = 0
    # int8 out: (divisor, lo, hi), y = int8(clamp(round(float(fp16 y) / divisor), lo, hi)) (``HalfQuantize``:
    # attention's context quantized with its one calibrated scale for the output projection)
    quantize: tuple[float, float, float] | None = None

    @property
    def strides(self) -> dict[str, tuple[int, int]]:
        """Per operand, (leading dimension, batch stride) in elements: what CUTLASS's ``GemmBatched`` is given."""
        p = self.problem
        contiguous = {"a": (p.k, p.m * p.k), "w": ((p.k if self.b_column_major else p.n), p.k * p.n),
                      "y": (p.n, p.m * p.n)}
        views = {"a": self.a_view, "w": self.b_view, "y": self.y_view}
        return {name: tuple(views[name] or contiguous[name]) for name in contiguous}

    @property
    def function(self) -> str:
        return f"cutlass_{self.name}"

    @property
    def threads(self) -> int:
        return self.tile.threads

    @property
    def grid(self) -> tuple[int, int, int]:
        m, n, _ = self.problem.gemm
        return -(-m // self.tile.block[0]), -(-n // self.tile.block[1]), self.problem.batch

    @property
    def out_type(self) -> str:  # float32 out: the scores a softmax reads in float32 (no cast kernel between)
        return "int8_t" if self.quantize else "float" if self.float_out else "cutlass::half_t"

    @property
    def out_dtype(self) -> str:
        return "int8" if self.quantize else "float32" if self.float_out else "float16"

    @property
    def alignment(self) -> int:
        """Elements per global access of a, w and y: the largest of 8, 4, 2, 1 dividing every contiguous extent,
        leading dimension and batch stride (a window's 49 tokens: 1, which cp.async cannot load, so such a kernel has
        CUTLASS's two-stage mainloop with plain loads, ``gemm_tile``)."""
        p = self.problem
        extents = [p.k, p.k if self.b_column_major else p.n, p.n, self.a_offset, self.b_offset,
                   *(v for pair in self.strides.values() for v in pair)]
        return next(a for a in (8, 4, 2, 1) if all(e % a == 0 for e in extents))

    @property
    def out_lanes(self) -> int:  # 16-byte stores where the alignment allows
        return min(4 if self.float_out else ALIGNMENT, self.alignment)

    @property
    def b_layout(self) -> str:
        return "ColumnMajor" if self.b_column_major else "RowMajor"

    @property
    def epilogue(self) -> str:
        if self.quantize:
            return f"edgeq_cutlass::HalfQuantize<{self.out_lanes}>"
        return f"cutlass::epilogue::thread::LinearCombination<{self.out_type}, {self.out_lanes}, float, float>"

    @property
    def kernel_type(self) -> str:
        (bm, bn, bk), (wm, wn, wk) = self.tile.block, self.tile.warp
        return (
            "typename cutlass::gemm::kernel::DefaultGemm<"
            f"cutlass::half_t, cutlass::layout::RowMajor, {self.alignment}, cutlass::half_t, "
            f"cutlass::layout::{self.b_layout}, {self.alignment}, {self.out_type}, cutlass::layout::RowMajor, float, "
            "cutlass::arch::OpClassTensorOp, "
            f"cutlass::arch::Sm80, cutlass::gemm::GemmShape<{bm}, {bn}, {bk}>, "
            f"cutlass::gemm::GemmShape<{wm}, {wn}, {wk}>, cutlass::gemm::GemmShape<16, 8, 16>, "
            f"{self.epilogue}, "
            f"cutlass::gemm::threadblock::GemmBatchedIdentityThreadblockSwizzle, {self.tile.stages}, false, "
            "cutlass::arch::OpMultiplyAdd>::GemmKernel"
        )


C_TYPES = {"float16": "half", "int8": "int8_t", "int32": "int32_t", "float32": "float"}


def _c_float(v: float) -> str:
    """A float32 literal of ``v`` (infinities as the largest float, which clamps nothing finite)."""
    if math.isinf(v):
        return "-3.402823466e+38f" if v < 0 else "3.402823466e+38f"
    return f"{float(np.float32(v))!r}f"


def device_source(kernels: Sequence[ConvKernel]) -> str:
    """The CUDA source of the kernels' device wrappers: ``edgeq_cutlass_<name>(operands..., smem)`` (the operands of
    ``kernel_operands``) and, per kernel, ``edgeq_smem_<name>``, an array as large as the kernel's shared storage
    and Params, compiled only where ``EDGEQ_SIZING`` is defined (``smem_sizes`` reads it from that cubin's symbol
    table; the module does not carry it). Serial split-K kernels get their own semaphores, one an output tile, at
    ``split_k_offsets`` in one zero-initialized array."""
    out = [PREAMBLE]
    token_linear = [k for k in kernels if isinstance(k, TokenLinearKernel)]
    if token_linear:  # cute's headers only where a kernel needs them; each visitor tree once
        trees = dict(token_linear_types(k) for k in token_linear)
        out.append(EVT_INCLUDES + "namespace edgeq_cutlass {" + "".join(trees.values()) + "}  // namespace edgeq_cutlass\n")
    offsets, locks = split_k_offsets(kernels)
    if locks:  # serial split-K's semaphores, one an output tile: zero when the module loads, and each kernel's last
        # slice sets its tile's back to zero; each kernel has its own (a launch that never finished leaves only its
        # own tiles' set, and no two kernels share a semaphore)
        out.append(f"namespace edgeq_cutlass {{ __device__ int split_k_locks[{locks}]; }}\n")
    for kern in kernels:
        if isinstance(kern, DepthwiseKernel):  # TIR: TVM writes its CUDA
            continue
        p = kern.problem
        t = f"Kernel_{kern.name}"
        if isinstance(kern, GemmKernel):
            out.append(_gemm_source(kern))
            continue
        signature = ", ".join(f"{C_TYPES[dtype]}* {name}" for name, _, dtype in kernel_operands(kern))
        if isinstance(kern, TokenLinearKernel):
            out.append(_token_linear_source(kern, signature))
            continue
        if isinstance(kern, GroupConvKernel):
            out.append(_group_source(kern, signature))
            continue
        ct = kern.x_channels  # a channel slice of a wider tensor: its first channel, the tensor's strides
        x_offset = f" + {kern.x_view[0]}" if kern.x_view else ""
        x_layout = (_nhwc_layout(p.n, p.h, p.w, ct) if kern.x_view
                    else f"layout::TensorNHWC::packed({{{p.n}, {p.h}, {p.w}, {p.c}}})")
        out_layout = _nhwc_layout(p.n, p.p, p.q, kern.out_channels)  # y: a slice of a concatenation's channels
        y_offset = f" + {kern.out_view[0]}" if kern.out_view else ""
        d_ref, tensor = f"{{reinterpret_cast<OUT*>(y){y_offset}, out_layout}}", "nullptr, 0, 0"
        c_ref = d_ref  # no residual: the source is y (unread)
        if kern.residual:  # the residual: maybe a slice of a wider tensor's channels
            first, channels = kern.residual_view or (0, p.k)
            c_ref = (f"{{reinterpret_cast<OUT*>(residual){f' + {first}' if first else ''}, "
                     f"{_nhwc_layout(p.n, p.p, p.q, channels)}}}")
        if kern.up_view:  # T: the output upsampled (Upsample2xIterator), from the tensor's first channel
            tensor = f"y_up + {kern.up_view[0]}, 0, {kern.up_view[1]}"
        if kern.head_out:  # T: the detector's output, from the kernel's first channel and anchor (Z is not stored)
            first, anchor, _, anchors, _ = kern.head_out
            tensor = f"y + {first * anchors + anchor}, 0, 0"
        if kern.precision == "int8" and kern.residual_type != kern.output_dtype:  # out through T (row stride K)
            res = C_TYPES[kern.residual_type]
            c_ref = d_ref = f"{{reinterpret_cast<{res}*>(residual), out_layout}}"
            tensor = f"y, 0, {p.k}"
        if kern.precision == "int8":
            element, out_element = "int8_t", ("float" if kern.float_out else "int8_t")
            output_op = (f"edgeq_cutlass::RequantParams{{bias, scale, shift, {_c_float(kern.residual_scale)}, "
                         f"{_c_float(kern.act_lo)}, {_c_float(kern.act_hi)}, {_c_float(kern.out_div)}, "
                         f"{_c_float(kern.lo)}, {_c_float(kern.hi)}, {int(kern.residual)}, {int(kern.silu)}, "
                         f"{'post' if kern.post else 'nullptr'}}}")
            vector = "channel"
        elif kern.residual_after:
            element, out_element, output_op = "half_t", "half_t", "{}"
            vector = "reinterpret_cast<half_t*>(bias)"
        else:
            element, out_element = "half_t", ("float" if kern.float_out else "half_t")
            output_op = f"{{1.0f, {'1.0f' if kern.residual else '0.0f'}}}"
            vector = f"reinterpret_cast<{'float' if kern.float_bias else 'half_t'}*>(bias)"
        out.append(_wrapper(kern.name, f"using {t} = {kern.kernel_type};", signature, f"""
    conv::Conv2dProblemSize problem({p.n}, {p.h}, {p.w}, {p.c}, {p.k}, {p.r}, {p.s}, {p.p}, {p.q}, {p.pad[0]}, {p.pad[1]},
                                    {p.stride[0]}, {p.stride[1]}, {p.dilation[0]}, {p.dilation[1]},
                                    conv::Mode::kCrossCorrelation, {kern.tile.split_k});
    layout::TensorNHWC out_layout = {out_layout};
    typename K::Arguments args(
        problem, {{reinterpret_cast<{element}*>(x){x_offset}, {x_layout}}},
        {{reinterpret_cast<{element}*>(w), layout::TensorNHWC::packed({{{p.k}, {p.r}, {p.s}, {p.c}}})}},
        {c_ref.replace("OUT", out_element)}, {d_ref.replace("OUT", out_element)},
        {output_op}, conv::SplitKMode::kSerial, {vector}, {tensor});
    new (params) typename K::Params(args{f", edgeq_cutlass::split_k_locks + {offsets[kern.name]}"
                                         if kern.tile.split_k > 1 else ""});"""))
    return "".join(out)


def split_k_offsets(kernels: Sequence[ConvKernel]) -> tuple[dict[str, int], int]:
    """({split kernel: its first semaphore in ``split_k_locks``}, the array's length): one semaphore an output tile
    (grid x and y) of each serial split-K kernel, in the order of their names (whatever order they come in)."""
    offsets, total = {}, 0
    for k in sorted(kernels, key=lambda k: k.name):
        if getattr(k, "tile", None) and k.tile.split_k > 1:
            offsets[k.name] = total
            total += k.grid[0] * k.grid[1]
    return offsets, total


def _nhwc_layout(n: int, h: int, w: int, channels: int) -> str:
    """CUTLASS's NHWC layout of an [n, h, w, channels] tensor, as its strides (a slice of its channels keeps them)."""
    return f"layout::TensorNHWC({channels}, {w * channels}, {h * w * channels})"


def _wrapper(name: str, types: str, signature: str, build: str) -> str:
    """The device wrapper of one CUTLASS kernel: ``types`` (C++ in namespace edgeq_cutlass that defines
    ``Kernel_<name>``), an array as large as the kernel's shared storage and its Params (``smem_sizes`` reads its size
    from the cubin), and ``edgeq_cutlass_<name>(signature..., smem)``, in which thread 0 runs ``build`` (C++ that
    constructs the kernel's Params at ``params``, in shared memory after its storage: no thread keeps them on its
    stack) and the block then runs the kernel."""
    t = f"Kernel_{name}"
    return f"""
namespace edgeq_cutlass {{ {types} }}
// the kernel's shared storage, then its Params (built once per block, by thread 0)
constexpr size_t edgeq_params_at_{name} = (sizeof(edgeq_cutlass::{t}::SharedStorage) + 15) / 16 * 16;
#ifdef EDGEQ_SIZING  // only in smem_sizes' compile: the shipped module holds no such array
__device__ char edgeq_smem_{name}[edgeq_params_at_{name} + sizeof(typename edgeq_cutlass::{t}::Params)];
#endif
extern "C" __device__ void edgeq_cutlass_{name}({signature}, unsigned char* smem) {{
  using namespace cutlass;
  using K = edgeq_cutlass::{t};
  auto* params = reinterpret_cast<typename K::Params*>(smem + edgeq_params_at_{name});
  if (threadIdx.x == 0) {{{build}
  }}
  __syncthreads();
  K op;
  op(*params, *reinterpret_cast<typename K::SharedStorage*>(smem));
}}
"""


def _group_source(kern: GroupConvKernel, signature: str) -> str:
    """A grouped convolution's device wrapper (as ``device_source``'s convolutions': Params built in shared memory);
    the bias is the epilogue's source C with every stride 0."""
    p = kern.problem
    return _wrapper(kern.name, f"using Kernel_{kern.name} = {kern.kernel_type};", signature, f"""
    conv::Conv2dProblemSize problem({p.n}, {p.h}, {p.w}, {p.c}, {p.k}, {p.r}, {p.s}, {p.p}, {p.q}, {p.pad[0]}, {p.pad[1]},
                                    {p.stride[0]}, {p.stride[1]}, {p.dilation[0]}, {p.dilation[1]},
                                    conv::Mode::kCrossCorrelation, 1, {p.groups});
    typename K::Arguments args(
        problem, {{reinterpret_cast<half_t*>(x), layout::TensorNHWC::packed({{{p.n}, {p.h}, {p.w}, {p.c}}})}},
        {{reinterpret_cast<half_t*>(w), layout::TensorNHWC::packed({{{p.k}, {p.r}, {p.s}, {kern.channels_per_group}}})}},
        {{reinterpret_cast<half_t*>(bias), layout::TensorNHWC(0, 0, 0)}},
        {{reinterpret_cast<half_t*>(y), layout::TensorNHWC::packed({{{p.n}, {p.p}, {p.q}, {p.k}}})}},
        {{1.0f, 1.0f}});
    new (params) typename K::Params(args);""")


EVT_INCLUDES = r"""
#include <cutlass/gemm/kernel/default_gemm_universal_with_visitor.h>
#include <cutlass/epilogue/threadblock/fusion/visitors.hpp>
"""


@functools.lru_cache(maxsize=None)  # its kernel type, the module's source and its wrapper each ask for it
def token_linear_types(kern: TokenLinearKernel) -> tuple[str, str]:
    """(its name, the C++ that defines it) of a per-token int8 linear layer's epilogue visitor tree ``Evt_<name>``:
    its functor (the graph's float32 operators, in their order, rounding as they do), the tree that hands it the
    accumulators, the weight scale and bias of its column, the token scale of its row [and the residual], and the
    store. Named by its content: layers with the same tile and epilogue (a transformer's layers) share one, so
    NVRTC instantiates CUTLASS's templates once for them."""
    out = "cutlass::half_t" if kern.out_dtype == "float16" else "float"
    (bm, bn, bk), (wm, wn, wk) = kern.tile.block, kern.tile.warp
    steps = ["float v = __fadd_rn(__fmul_rn(__fmul_rn(acc[i], scale[i]), token[i]), bias[i]);"]
    if kern.gelu is not None:
        constant, divide, half, one, half_first = kern.gelu
        scaled = f"__fdiv_rn(v, {_c_float(constant)})" if divide else f"__fmul_rn(v, {_c_float(constant)})"
        steps.append(f"float t = __fadd_rn(erff({scaled}), {_c_float(one)});")
        steps.append(f"v = __fmul_rn(__fmul_rn(v, {_c_float(half)}), t);" if half_first
                     else f"v = __fmul_rn(__fmul_rn(v, t), {_c_float(half)});")
    if kern.residual:
        steps.append("v = __fadd_rn(v, residual[i]);")
    array = "cutlass::Array<float, N> const&"
    inputs = f"{array} acc, {array} scale, {array} token, {array} bias" + (f", {array} residual" if kern.residual else "")
    nodes = "cutlass::epilogue::threadblock"
    row, column = "cute::Stride<cute::_0, cute::_1, int32_t>", "cute::Stride<cute::_1, cute::_0, int32_t>"
    matrix = "cute::Stride<int64_t, cute::_1, int64_t>"
    residual_node = f", {nodes}::VisitorAuxLoad<Map_@, float, {matrix}>" if kern.residual else ""
    body = "\n".join("      " + step for step in steps)
    text = f"""
template <class T> struct Epilogue_@;
template <int N> struct Epilogue_@<cutlass::Array<float, N>> {{
  CUTLASS_DEVICE cutlass::Array<float, N> operator()({inputs}) const {{
    cutlass::Array<float, N> y;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < N; ++i) {{
{body}
      y[i] = v;
    }}
    return y;
  }}
}};
using Map_@ = {nodes}::OutputTileThreadLayout<cutlass::gemm::GemmShape<{bm}, {bn}, {bk}>,
    cutlass::gemm::GemmShape<{wm}, {wn}, {wk}>, {out}, {kern.out_lanes}, 1>;
using Compute_@ = {nodes}::Sm80EVT<
    {nodes}::VisitorCompute<Epilogue_@, {out}, float, cutlass::FloatRoundStyle::round_to_nearest>,
    {nodes}::VisitorAccFetch, {nodes}::VisitorRowBroadcast<Map_@, float, {row}>,
    {nodes}::VisitorColBroadcast<Map_@, float, {column}>, {nodes}::VisitorRowBroadcast<Map_@, float, {row}>
    {residual_node}>;
using Evt_@ = {nodes}::Sm80EVT<
    {nodes}::VisitorAuxStore<Map_@, {out}, cutlass::FloatRoundStyle::round_to_nearest, {matrix}>, Compute_@>;
"""
    key = "t" + hashlib.sha1(text.encode()).hexdigest()[:12]
    return key, text.replace("@", key)


def _token_linear_source(kern: TokenLinearKernel, signature: str) -> str:
    """A per-token int8 linear layer's device wrapper (as ``device_source``'s convolutions': Params built in shared
    memory) over its visitor tree (``token_linear_types``, defined once in front of the wrappers)."""
    p, kn = kern.problem, kern.name
    m, n, c = kern.rows, p.k, p.c
    out = "cutlass::half_t" if kern.out_dtype == "float16" else "float"
    evt = token_linear_types(kern)[0]
    per_row, per_column = f"{{cute::_1{{}}, cute::_0{{}}, int32_t({m})}}", f"{{cute::_0{{}}, cute::_1{{}}, int32_t({n})}}"
    dense = f"{{int64_t({n}), cute::_1{{}}, int64_t({m * n})}}"
    residual_arg = f"{{residual, 0.f, {dense}}}, " if kern.residual else ""
    return _wrapper(kn, f"using Kernel_{kn} = {kern.kernel_type};", signature, f"""
    typename edgeq_cutlass::Evt_{evt}::Arguments evt{{
        {{{{}}, {{scale, 0.f, {per_column}}}, {{token, 0.f, {per_row}}}, {{bias, 0.f, {per_column}}}, {residual_arg}{{}}}},
        {{reinterpret_cast<{out}*>(y), {dense}}}}};
    typename K::Arguments args(gemm::GemmUniversalMode::kGemm, gemm::GemmCoord({m}, {n}, {c}), 1, evt,
                               x, w, nullptr, nullptr, {m * c}LL, {n * c}LL, 0LL, 0LL, {c}, {c}, 0, 0);
    new (params) typename K::Params(args, {kern.grid[0] * kern.grid[1]}, 1);""")


def _gemm_source(kern: GemmKernel) -> str:
    """A batched GEMM's device wrapper (as ``device_source``'s convolutions': Params built in shared memory)."""
    p, kn = kern.problem, kern.name
    gm, gn, batch = kern.grid
    (lda, bsa), (ldb, bsb), (ldc, bsc) = (kern.strides[name] for name in ("a", "w", "y"))
    out, element = {"int8": ("int8_t", "int8_t"), "float32": ("float", "float"),
                    "float16": ("half", "half_t")}[kern.out_dtype]
    output_op = (f"edgeq_cutlass::HalfQuantizeParams{{{_c_float(kern.alpha)}, {_c_float(kern.quantize[0])}, "
                 f"{_c_float(kern.quantize[1])}, {_c_float(kern.quantize[2])}}}" if kern.quantize
                 else f"typename K::OutputOp::Params({_c_float(kern.alpha)}, 0.0f)")
    types = (f"using Default_{kn} = {kern.kernel_type};\nusing Kernel_{kn} = cutlass::gemm::kernel::GemmBatched<"
             f"Default_{kn}::Mma, Default_{kn}::Epilogue, cutlass::gemm::threadblock::GemmBatchedIdentityThreadblockSwizzle>;")
    return _wrapper(kn, types, f"half* a, half* w, {out}* y", f"""
    new (params) typename K::Params(
        gemm::GemmCoord({p.m}, {p.n}, {p.k}), gemm::GemmCoord({gm}, {gn}, {batch}),
        {{reinterpret_cast<half_t*>(a) + {kern.a_offset}, layout::RowMajor({lda})}}, {bsa}LL,
        {{reinterpret_cast<half_t*>(w) + {kern.b_offset}, layout::{kern.b_layout}({ldb})}}, {bsb}LL,
        {{reinterpret_cast<{element}*>(y), layout::RowMajor({ldc})}}, {bsc}LL,
        {{reinterpret_cast<{element}*>(y), layout::RowMajor({ldc})}}, {bsc}LL,
        {output_op}, {batch});""")


def nvrtc_options() -> str:
    """NVRTC options CUTLASS needs beyond TVM's (``TVM_CUDA_NVRTC_EXTRA_OPTS``): C++17 and its include folder."""
    return f"-std=c++17 -DCUTLASS_ENABLE_TENSOR_CORE_MMA=1 -I{cutlass_include()}"


@contextlib.contextmanager
def wrappers_in_module(kernels: Sequence[ConvKernel]) -> Iterator[None]:
    """For the duration of a build: the kernels' wrappers go in front of any CUDA source that calls one, and
    NVRTC finds CUTLASS's headers."""
    import tvm_ffi

    by_name = {k.name: k for k in kernels}
    previous = tvm_ffi.get_global_func("tvm_callback_cuda_postproc", allow_missing=True)

    def postproc(code, target=None):
        used = [by_name[n] for n in sorted(set(re.findall(r"edgeq_cutlass_(\w+)\(", code))) if n in by_name]
        return device_source(used) + "\n" + code if used else code

    tvm_ffi.register_global_func("tvm_callback_cuda_postproc", postproc, override=True)
    try:
        with _nvrtc_include():
            yield
    finally:
        if previous is not None:
            tvm_ffi.register_global_func("tvm_callback_cuda_postproc", previous, override=True)
        else:
            tvm_ffi.register_global_func("tvm_callback_cuda_postproc", lambda code, target=None: code, override=True)


def kernel_operands(kernel: ConvKernel, shapes: dict | None = None) -> list[tuple[str, tuple, str]]:
    """(name, shape, dtype) of the kernel's operands in the order its PrimFunc and device wrapper take them:
    fp16: x, w, bias, [residual], y; int8: x, w, bias (int32), scale, shift, [post], channel (float32: the output channel's
    index, the epilogue's broadcast vector; not for a depthwise kernel), [residual], y; a ``TokenLinearKernel``:
    x, w, scale, token, bias (float32), [residual], y. ``shapes``: the per-channel operands' shapes as the
    graph holds them (K elements; default [K])."""
    p = kernel.problem
    shapes = shapes or {}
    if isinstance(kernel, GemmKernel):  # a, w, y: [batch, M, K], [batch, K, N], [batch, M, N] or the graph's shapes
        return [("a", tuple(shapes.get("a", (p.batch, p.m, p.k))), "float16"),
                ("w", tuple(shapes.get("w", (p.batch, p.k, p.n))), "float16"),
                ("y", tuple(shapes.get("y", (p.batch, p.m, p.n))), kernel.out_dtype)]
    xs, ws, ys = (p.n, p.h, p.w, kernel.x_channels), (p.k, p.r, p.s, p.c), (p.n, p.p, p.q, p.k)
    if p.depthwise:  # HWOI
        ws = (p.r, p.s, p.k, 1)
    elif p.groups > 1:  # grouped: each output channel's filter sees its group's C / groups channels
        ws = (p.k, p.r, p.s, p.c // p.groups)

    def vec(name):
        return tuple(shapes.get(name, (p.k,)))

    ys = (p.n, p.p, p.q, kernel.out_channels) if kernel.out_view else tuple(shapes.get("y", ys))
    bs = vec("bias")
    if isinstance(kernel, TokenLinearKernel):  # x, w, scale, token ([..., M, 1]: a row's), bias, [residual], y
        residual = [("residual", ys, "float32")] if kernel.residual else []
        return [("x", xs, "int8"), ("w", ws, "int8"), ("scale", vec("scale"), "float32"),
                ("token", tuple(shapes.get("token", (kernel.rows, 1))), "float32"), ("bias", bs, "float32"), *residual,
                ("y", ys, kernel.out_dtype)]
    if kernel.precision == "int8":
        ops = [("x", xs, "int8"), ("w", ws, "int8"), ("bias", bs, "int32"), ("scale", vec("scale"), "float32"),
               ("shift", vec("shift"), "float32")]
        if kernel.post:
            ops.append(("post", vec("post"), "float32"))
        if not isinstance(kernel, DepthwiseKernel):  # CUTLASS's epilogue: the channel index as broadcast vector
            ops.append(("channel", (p.k,), "float32"))
        act = "float32" if kernel.float_out else "int8"
    else:
        ops = [("x", xs, "float16"), ("w", ws, "float16"), ("bias", bs, kernel.bias_dtype)]
        act = "float32" if kernel.float_out else "float16"
    if kernel.residual:
        rs = (p.n, p.p, p.q, kernel.residual_view[1]) if kernel.residual_view else (p.n, p.p, p.q, p.k) \
            if kernel.out_view else ys
        ops.append(("residual", rs, kernel.residual_type))
    if getattr(kernel, "up_view", None):  # the upsampled copy's tensor, written in place (before y: the call's new
        # output comes last)
        ops.append(("y_up", (p.n, 2 * p.p, 2 * p.q, kernel.up_view[1]), act))
    if getattr(kernel, "head_out", None):  # y: the detector's whole output
        ys, act = (p.n, kernel.head_out[2], kernel.head_out[3]), kernel.head_out[4]
    return ops + [("y", ys, act)]


def prim_func(kernel: ConvKernel, smem_bytes: int, shapes: dict | None = None):
    """The scheduled TIR function TVM launches for ``kernel``: its grid and block, ``smem_bytes`` of dynamic shared
    memory, and one call of the device wrapper with the operands of ``kernel_operands`` (TVMScript, written out
    for this kernel's operands and parsed)."""
    if isinstance(kernel, DepthwiseKernel):
        return depthwise_prim_func(kernel, shapes)
    from tvm.script import tirx as T

    from edgeq.tvm_env import import_tvm

    tvm = import_tvm()
    (gm, gn, *gz), threads = kernel.grid, kernel.threads
    smem_bytes = -(-smem_bytes // 16) * 16
    ops = kernel_operands(kernel, shapes)
    buf = {name: f"B_{name}" for name, _, _ in ops}

    def region(name, shape):
        return f"{buf[name]}[{', '.join(f'0:{d}' for d in shape)}]"

    outputs = [o for o in ops if o[0] in ("y", "y_up")]
    inputs = [o for o in ops if o not in outputs]
    text = "\n".join([
        "@T.prim_func(s_tir=True)",
        f"def func({', '.join(f'{name}: T.handle' for name, _, _ in ops)}):",
        # (a kernel writing a slice of a concatenation may read another slice of it: its operands may alias)
        f'    T.func_attr({{"tirx.noalias": {not (kernel.out_view or kernel.up_view)}}})' if isinstance(kernel, ConvKernel)
        else '    T.func_attr({"tirx.noalias": True})',
        *(f'    {buf[name]} = T.match_buffer({name}, {tuple(shape)}, "{dtype}")' for name, shape, dtype in ops),
        '    with T.sblock("root"):',
        f'        for bx in T.thread_binding({gm}, thread="blockIdx.x"):',
        f'            for by in T.thread_binding({gn}, thread="blockIdx.y"):',
        *([f'              for bz in T.thread_binding({gz[0]}, thread="blockIdx.z"):'] if gz else []),
        f'                for tx in T.thread_binding({threads}, thread="threadIdx.x"):',
        '                    with T.sblock("cutlass"):',
        f'                        T.reads({", ".join(region(n, s) for n, s, _ in inputs)})',
        f'                        T.writes({", ".join(region(n, s) for n, s, _ in outputs)})',
        # inside the kernel: the block's dynamic shared memory (extern __shared__), not a buffer passed in
        f'                        smem = T.alloc_buffer(({smem_bytes},), "uint8", scope="shared.dyn")',
        f'                        T.evaluate(T.call_extern("void", "edgeq_cutlass_{kernel.name}", '
        f'{", ".join(buf[n] + ".data" for n, _, _ in ops)}, smem.data))',
    ])
    func = tvm.script.from_source(text, extra_vars={"T": T})
    # op_pattern 8 (opaque): never fused
    return func.with_attrs({"global_symbol": kernel.function, "tirx.is_scheduled": True, "op_pattern": 8})


def depthwise_prim_func(kernel: DepthwiseKernel, shapes: dict | None = None):
    """A depthwise kernel's TIR: ``twin_prim_func``'s computation (the host twin is this function before its
    schedule) scheduled for the GPU: output pixels x channel groups of DEPTHWISE_LANES over the threads, per thread
    the accumulators, the padded input's and the weights' lanes and the epilogue's outputs in registers (loads and
    the store vectorized), the R x S taps unrolled."""
    from edgeq.tvm_env import Schedule, import_tvm

    tvm = import_tvm()
    sch = Schedule(tvm.IRModule({"main": twin_prim_func(kernel, shapes)}))
    sch.cache_write(sch.get_sblock("y"), 0, "local")
    epilogue, store, acc, padded = (sch.get_sblock(n) for n in ("y", "y_local", "acc", "xp"))
    n, p, q, k = sch.get_loops(store)
    k_outer, lanes = sch.split(k, [None, DEPTHWISE_LANES])
    bx, tx = sch.split(sch.fuse(n, p, q, k_outer), [None, DEPTHWISE_THREADS])
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")
    sch.vectorize(lanes)
    sch.compute_at(epilogue, tx)
    sch.compute_at(acc, tx)
    sch.set_scope(acc, 0, "local")
    channel, ry, rx = sch.get_loops(acc)[-3:]
    sch.reorder(ry, rx, channel)
    # (no decompose_reduction: for some shapes TVM's simplified thread bindings are not quasi-affine, which it
    # refuses; the init stays a `ry == 0 and rx == 0` branch that unrolling folds away)
    weights = sch.cache_read(acc, "w", "local")
    sch.compute_at(padded, rx)
    sch.set_scope(padded, 0, "local")
    # int8: 4-byte loads (TVM 0.27 writes an 8-lane int8 zero as make_int2 of 8 chars, which NVRTC refuses)
    outer, inner = sch.split(sch.get_loops(padded)[-1], [None, 4 if kernel.precision == "int8" else DEPTHWISE_LANES])
    sch.vectorize(inner)
    sch.unroll(outer)
    sch.compute_at(weights, rx)
    sch.vectorize(sch.get_loops(weights)[-1])
    for loop in (ry, rx, channel, sch.get_loops(epilogue)[-1]):
        sch.unroll(loop)
    return sch.mod["main"].with_attrs({"global_symbol": kernel.function, "tirx.is_scheduled": True, "op_pattern": 8})


def _x_slice(kernel, x: np.ndarray) -> np.ndarray:
    """The channels of x a kernel reads (``ConvKernel.x_view``: a slice of a wider tensor)."""
    if getattr(kernel, "x_view", None) is None:
        return x
    c0 = kernel.x_view[0]
    return x[..., c0:c0 + kernel.problem.c]


def _accumulate(p: Conv2dProblem, x: np.ndarray, w: np.ndarray, dtype) -> np.ndarray:
    """The convolution's sums [N, P, Q, K] in ``dtype`` (float32, or int64: exact for int8): x NHWC, w OHWI (a
    depthwise problem's HWOI [R, S, K, 1]), zero padding; bottom/right padding is what the output size reaches
    (CUTLASS's implicit-GEMM iterators)."""
    (ph, pw), (sh, sw), (dh, dw) = p.pad, p.stride, p.dilation
    xp = np.zeros((p.n, p.h + 2 * ph + p.r * dh, p.w + 2 * pw + p.s * dw, p.c), dtype)
    xp[:, ph:ph + p.h, pw:pw + p.w, :] = x
    acc = np.zeros((p.n, p.p, p.q, p.k), dtype)
    wd = w.astype(dtype)
    for i in range(p.r):
        for j in range(p.s):
            patch = xp[:, i * dh:i * dh + sh * (p.p - 1) + 1:sh, j * dw:j * dw + sw * (p.q - 1) + 1:sw, :]
            if p.depthwise:  # one filter per channel
                acc += patch * wd[i, j, :, 0]
            elif p.groups > 1:  # group g: output channels [g kg, (g + 1) kg) from input channels [g cg, (g + 1) cg)
                kg, cg = p.k // p.groups, p.c // p.groups
                for g in range(p.groups):
                    acc[..., g * kg:(g + 1) * kg] += np.einsum("npqc,kc->npqk", patch[..., g * cg:(g + 1) * cg],
                                                               wd[g * kg:(g + 1) * kg, i, j, :], optimize=True)
            else:
                acc += np.einsum("npqc,kc->npqk", patch, wd[:, i, j, :], optimize=True)
    return acc


def replay(kernel: ConvKernel, x: np.ndarray, w: np.ndarray, bias: np.ndarray,
           residual: np.ndarray | None = None) -> np.ndarray:
    """What the kernel is asked to compute, on the host in float32 (independent of CUTLASS and TVM): x NHWC
    [N, H, W, C], w OHWI [K, R, S, C] (channels padded), bias [K]; the result rounded to fp16 as the epilogue's
    conversion does (float32 unrounded for a ``float_out`` kernel); the residual added before the bias, or after the
    activation (``residual_after``); with split-K (``Tile.split_k``) the slices' partial sums in CUTLASS's order,
    each rounded to the output's type. Bottom/right padding is what the output size reaches (CUTLASS's implicit-GEMM
    iterators)."""
    x = _x_slice(kernel, x)
    slices = kernel.tile.split_k if kernel.tile is not None else 1
    out = np.float32 if kernel.float_out else np.float16
    if slices > 1:  # serial split-K: slice j sums the channel tiles t with t % slices == j (every filter tap); each
        # slice adds the partial sum the one before left in the output, in the output's type
        tile_of = np.arange(kernel.problem.c) // kernel.tile.block[2] % slices
        parts = [_accumulate(kernel.problem, np.where(tile_of == j, x, 0), w, np.float32) for j in range(slices)]
        acc = parts[0] + (residual.reshape(parts[0].shape).astype(np.float32) if residual is not None else 0)
        for part in parts[1:]:
            acc = part + acc.astype(out).astype(np.float32)
    else:
        acc = _accumulate(kernel.problem, x, w, np.float32)
        if residual is not None and not kernel.residual_after:
            acc = acc + residual.reshape(acc.shape).astype(np.float32)
    z = acc + bias.astype(np.float32)
    z = {"identity": lambda v: v, "relu": lambda v: np.maximum(v, 0), "relu6": lambda v: np.clip(v, 0, 6),
         "silu": lambda v: v / (1 + np.exp(-v)), "hardswish": lambda v: v * np.clip(v + 3, 0, 6) / 6,
         "gelu": lambda v: 0.5 * v * (1 + _erf(v / np.sqrt(2.0)))}[kernel.activation](z)
    if residual is not None and kernel.residual_after:  # ``BiasActResidual``: after the activation
        z = z + residual.reshape(z.shape).astype(np.float32)
    return z.astype(out)


def replay_int8(kernel: ConvKernel, x: np.ndarray, w: np.ndarray, bias: np.ndarray, scale: np.ndarray,
                shift: np.ndarray | None = None, residual: np.ndarray | None = None,
                post: np.ndarray | None = None) -> np.ndarray:
    """What an int8 kernel is asked to compute, on the host (numpy, independent of CUTLASS and TVM): x int8 NHWC,
    w int8 OHWI, bias int32 [K], scale float32 [K]; exact integer accumulation, then the ``Requantize`` epilogue's
    float32 steps, rounding half to even."""
    acc = _accumulate(kernel.problem, _x_slice(kernel, x), w, np.int64)
    f32 = np.float32
    v = (acc + bias.reshape(-1).astype(np.int64)).astype(np.int32).astype(f32) * scale.reshape(-1).astype(f32)
    v = v + (f32(0) if shift is None else shift.reshape(-1).astype(f32))
    if kernel.silu:  # through edgeq's exp, as the device's epilogue (device_math.py)
        v = silu_rn_numpy(v)
    if residual is not None:
        v = v + residual.astype(f32) * f32(kernel.residual_scale)
    v = np.clip(v, f32(kernel.act_lo), f32(kernel.act_hi))
    if post is not None:
        v = v * post.reshape(-1).astype(f32)
    if kernel.float_out:
        return v.astype(f32)
    v = np.rint(v / f32(kernel.out_div))
    return np.clip(v, kernel.lo, kernel.hi).astype(np.int8)


def replay_gemm(kernel: GemmKernel, a: np.ndarray, w: np.ndarray) -> np.ndarray:
    """What a batched GEMM kernel is asked to compute, on the host (numpy): a [batch, M, K] and w [batch, K, N]
    fp16, products summed in float32, the result rounded to fp16 (float32 unrounded for ``float_out``).
    Operands read through a head view (``GemmKernel.strides``) are read as the kernel reads them, and the result
    is written into an array of y's size as the kernel writes it (returned flat in that case)."""
    p, st = kernel.problem, kernel.strides

    def view(array, shape, name, column_major=False, offset=0):
        ld, batch = st[name]
        flat = np.ascontiguousarray(array).reshape(-1)[offset:]
        strides = (batch, 1, ld) if column_major else (batch, ld, 1)
        return np.lib.stride_tricks.as_strided(flat, shape, [s * flat.itemsize for s in strides])

    product = np.matmul(view(a, (p.batch, p.m, p.k), "a", offset=kernel.a_offset).astype(np.float32),
                        view(w, (p.batch, p.k, p.n), "w", kernel.b_column_major, kernel.b_offset).astype(np.float32))
    y = (product * np.float32(kernel.alpha)).astype(np.float32 if kernel.float_out else np.float16)
    if kernel.quantize:  # the fp16 value / divisor, rounded half to even, clamped, int8
        divisor, lo, hi = (np.float32(v) for v in kernel.quantize)
        y = np.clip(np.rint(y.astype(np.float32) / divisor), lo, hi).astype(np.int8)
    if kernel.y_view is None:
        return y
    out = np.zeros(p.batch * p.m * p.n, y.dtype)
    view(out, (p.batch, p.m, p.n), "y")[...] = y
    return out


def replay_token_linear(kernel: TokenLinearKernel, x: np.ndarray, w: np.ndarray, scale: np.ndarray, token: np.ndarray,
                        bias: np.ndarray, residual: np.ndarray | None = None) -> np.ndarray:
    """What a ``TokenLinearKernel`` computes, in numpy (float32, each operator rounded on its own, as the kernel's
    ``__fmul_rn``/``__fadd_rn``; erf in float64, rounded): [M, N] from x [M, C] int8, w [N, C] int8, scale and bias
    [N], token [M] and residual [M, N] (any shapes of those sizes)."""
    p = kernel.problem
    acc = (x.reshape(-1, p.c).astype(np.int64) @ w.reshape(p.k, p.c).astype(np.int64).T).astype(np.float32)
    v = acc * scale.reshape(-1).astype(np.float32)
    v = v * token.reshape(-1, 1).astype(np.float32)
    v = v + bias.reshape(-1).astype(np.float32)
    if kernel.gelu is not None:
        constant, divide, half, one, half_first = (np.float32(c) if isinstance(c, float) else c for c in kernel.gelu)
        t = _erf(v / constant if divide else v * constant) + one
        v = (v * half) * t if half_first else (v * t) * half
    if residual is not None:
        v = v + residual.reshape(v.shape).astype(np.float32)
    return v.astype(kernel.out_dtype)

def _erf(v: np.ndarray) -> np.ndarray:
    from math import erf

    return np.vectorize(erf)(v.astype(np.float64)).astype(np.float32)


def pad_weights(w_oihw: np.ndarray, problem: Conv2dProblem) -> np.ndarray:
    """ONNX/Relax OIHW weights as the kernel takes them: OHWI, input channels padded with zeros."""
    ohwi = np.transpose(w_oihw, (0, 2, 3, 1))
    return np.pad(ohwi, ((0, 0), (0, 0), (0, 0), (0, problem.c - ohwi.shape[3])))


def pad_input(x_nchw: np.ndarray, problem: Conv2dProblem) -> np.ndarray:
    """An NCHW activation as the kernel takes it: NHWC, channels padded with zeros."""
    nhwc = np.transpose(x_nchw, (0, 2, 3, 1))
    return np.pad(nhwc, ((0, 0), (0, 0), (0, 0), (0, problem.c - nhwc.shape[3])))


def kernel_record(kernel: ConvKernel, smem_bytes: int) -> dict:
    """What the manifest says of one kernel: template (or edgeq's depthwise), tile, the problem, the epilogue,
    FLOPs."""
    p = kernel.problem
    if isinstance(kernel, GemmKernel):
        return {
            "function": kernel.function, "template": "GemmBatched over DefaultGemm (Sm80, fp16, fp32 "
            f"accumulation, row-major A, {kernel.b_layout.replace('Major', '-major').lower()} B)",
            "tile": list(kernel.tile.block), "warp": list(kernel.tile.warp),
            "stages": kernel.tile.stages, "threads": kernel.tile.threads, "grid": list(kernel.grid),
            "shared_bytes": smem_bytes, "problem": {"batch": p.batch, "mnk": [p.m, p.n, p.k]},
            "strides": {name: list(v) for name, v in kernel.strides.items()},
            "head_views": [name for name, v in (("a", kernel.a_view), ("w", kernel.b_view), ("y", kernel.y_view))
                           if v is not None],
            "offsets": {"a": kernel.a_offset, "w": kernel.b_offset},
            "alpha": kernel.alpha, "activation": "identity", "residual": False, "precision": kernel.precision,
            "output": kernel.out_dtype, "flops": p.flops,
            **({"quantize": {"divisor": kernel.quantize[0], "clamp": list(kernel.quantize[1:])}} if kernel.quantize
               else {}),
        }
    problem = {"nhwc": [p.n, p.h, p.w, p.c], "k": p.k, "rs": [p.r, p.s], "pad": list(p.pad), "stride": list(p.stride),
               "dilation": list(p.dilation), "output_pixels": p.n * p.p * p.q}
    if getattr(kernel, "x_view", None):  # channels [first, first + C) of an input with more
        problem["input_channels"] = {"first": kernel.x_view[0], "of": kernel.x_view[1]}
    if getattr(kernel, "out_view", None):  # channels [first, first + K) of a concatenation
        problem["output_channels"] = {"first": kernel.out_view[0], "of": kernel.out_view[1],
                                      "in_place": kernel.out_in_place}
    if getattr(kernel, "residual_view", None):
        problem["residual_channels"] = {"first": kernel.residual_view[0], "of": kernel.residual_view[1]}
    if getattr(kernel, "up_view", None):  # also nearest-upsampled 2x into channels [first, first + K) of a tensor
        problem["upsampled_2x_into_channels"] = {"first": kernel.up_view[0], "of": kernel.up_view[1]}
    if getattr(kernel, "head_out", None):  # channels [first, first + K) at anchors [anchor, anchor + P Q) of [N, C, A]
        first, anchor, channels, anchors, dtype = kernel.head_out
        problem["detector_output"] = {"channels": [first, first + p.k], "anchors": [anchor, anchor + p.p * p.q],
                                      "shape": [p.n, channels, anchors], "dtype": dtype}
    if isinstance(kernel, DepthwiseKernel):
        record = {
            "function": kernel.function, "template": f"edgeq depthwise (TIR: {DEPTHWISE_LANES} channels of an output "
            f"pixel per thread, {'int32' if kernel.precision == 'int8' else 'fp32'} accumulation)",
            "threads": kernel.threads, "grid": list(kernel.grid), "shared_bytes": 0,
            "problem": {**problem, "groups": p.groups},
        }
    else:
        template = ("DefaultConv2dFpropWithBroadcast (Sm80, s8 x s8 -> s32, edgeq's Requantize epilogue)"
                    if kernel.precision == "int8" else "DefaultConv2dFpropWithBroadcast (Sm80, fp16, fp32 accumulation)")
        if isinstance(kernel, TokenLinearKernel):
            template = ("DefaultGemmWithVisitor (Sm80, s8 x s8 -> s32, epilogue visitor tree: weight scale and bias "
                        "per column, token scale per row)")
        if isinstance(kernel, GroupConvKernel):
            template = (f"DefaultConv2dGroupFprop (Sm80, fp16, fp32 accumulation, {kernel.group_mode}, bias as a "
                        "zero-stride source)")
            problem["groups"] = p.groups
        record = {
            "function": kernel.function, "template": template,
            "tile": list(kernel.tile.block), "warp": list(kernel.tile.warp), "stages": kernel.tile.stages,
            "split_k": kernel.tile.split_k,
            "threads": kernel.tile.threads, "grid": list(kernel.grid), "shared_bytes": smem_bytes, "problem": problem,
        }
        if isinstance(kernel, GroupConvKernel):  # the tensor cores' work over the useful work
            record["tensor_core_work"] = kernel.work
    record.update({
        "activation": kernel.activation, "residual": kernel.residual, "precision": kernel.precision,
        "output": kernel.output_dtype, "flops": p.flops,
    })
    if kernel.residual:
        record["residual_dtype"] = kernel.residual_type
        record["residual_after_activation"] = getattr(kernel, "residual_after", False)
    if kernel.precision != "int8" and not isinstance(kernel, GemmKernel) and kernel.bias_dtype != "float16":
        record["bias_dtype"] = kernel.bias_dtype  # an fp16 layer of an int8 graph: its float32 bias
    if isinstance(kernel, TokenLinearKernel):  # y = float(acc) * scale[n] * token[m] + bias[n] [GELU] [+ residual]
        record["activation"] = "gelu" if kernel.gelu else "identity"
        record["token_scale"] = {"rows": kernel.rows, "bias": True, "gelu": list(kernel.gelu) if kernel.gelu else None}
        return record
    if kernel.precision == "int8":
        record["requantize"] = {
            "float_out": kernel.float_out, "silu": kernel.silu, "post_scale": kernel.post,
            "residual_scale": kernel.residual_scale,
            "out_div": kernel.out_div,
            "activation_clamp": [None if math.isinf(v) else v for v in (kernel.act_lo, kernel.act_hi)],
            "clamp": [kernel.lo, kernel.hi],
        }
    return record


@dataclasses.dataclass(frozen=True)
class KernelReport:
    """What the cubin says of one kernel: tensor-core instructions, registers, stack, spills, shared memory."""

    name: str
    arch: str
    mma: int  # tensor-core instructions in its SASS (HMMA for fp16, IMMA for int8)
    registers: int
    stack_bytes: int
    local_bytes: int  # local memory beyond the stack: spills
    shared_bytes: int  # dynamic shared memory it is launched with
    threads: int
    grid: tuple[int, int]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def smem_sizes(kernels: Sequence[ConvKernel], arch: str) -> dict[str, int]:
    """sizeof(SharedStorage) of each kernel, read from a cubin of its wrappers' types (NVRTC, no GPU); 0 for
    depthwise kernels (TIR, no shared memory). Only the ``edgeq_smem_`` arrays are compiled, not the wrapper
    functions: a type's size needs its definition, not its kernel's code, which NVRTC would otherwise instantiate
    and optimize twice (here and in the module)."""
    from tvm.support import nvcc

    sizes = {k.name: 0 for k in kernels if isinstance(k, DepthwiseKernel)}
    if len(sizes) == len(kernels):
        return sizes
    source = "#define EDGEQ_SIZING\n" + re.sub(r'extern "C" __device__ void edgeq_cutlass_\w+\(.*?\n}\n', "",
                                                device_source(kernels), flags=re.S)
    with _nvrtc_include():
        cubin = bytes(nvcc.compile_cuda(source, target_format="cubin", arch=arch))
    return {**elf_symbol_sizes(cubin, "edgeq_smem_"), **sizes}


@contextlib.contextmanager
def _nvrtc_include() -> Iterator[None]:
    saved = os.environ.get("TVM_CUDA_NVRTC_EXTRA_OPTS")
    os.environ["TVM_CUDA_NVRTC_EXTRA_OPTS"] = f"{saved or ''} {nvrtc_options()}".strip()
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("TVM_CUDA_NVRTC_EXTRA_OPTS", None)
        else:
            os.environ["TVM_CUDA_NVRTC_EXTRA_OPTS"] = saved


def build_module(kernels: Sequence[ConvKernel], target, toolkit, folder: Path,
                 math=None) -> tuple[Path, dict[str, int]]:
    """The kernels as one TVM module for ``target`` (``tvm.target.Target`` of kind cuda), exported as a shared
    library into ``folder`` with its CUDA source beside it (``cutlass_<arch>.cu``): (the library, {kernel: shared
    bytes}). ``math``: a ``device_math.DeviceMath`` other than the toolkit's (benchmarks/device_math.py)."""
    from edgeq.tvm_env import import_tvm

    tvm = import_tvm()
    from tvm.support import nvcc  # noqa: F401 - registers TVM's CUDA compile callback

    arch = target.attrs["arch"]
    with toolkit.active(math):
        sizes = smem_sizes(kernels, arch)
        mod = tvm.IRModule({k.function: prim_func(k, sizes[k.name]) for k in kernels})
        with wrappers_in_module(kernels), target:
            lib = tvm.tirx.build(mod, target=target)
    library = folder / f"cutlass_{arch}.so"
    lib.export_library(str(library))
    (folder / f"cutlass_{arch}.cu").write_text(lib.imports[0].inspect_source())
    return library, sizes


def read_kernels(library: Path, kernels: Sequence[ConvKernel], sizes: dict[str, int]) -> list[KernelReport]:
    """Each kernel's KernelReport, from the cubin in ``library`` (cuobjdump -sass and -res-usage)."""
    import subprocess
    import tempfile

    from edgeq.backends.cuda.cubin import cuda_images, cuda_tool

    cuobjdump = cuda_tool("cuobjdump")
    if cuobjdump is None:
        raise FileNotFoundError("cuobjdump not found: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm")
    env = {**os.environ, "PATH": f"{Path(cuobjdump).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    reports = []
    for image in cuda_images(library):
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(image.data)
            f.flush()
            sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, env=env).stdout
            usage = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True, env=env).stdout
        functions = dict(re.findall(r"Function ([\w$]+):\s*\n\s*(REG:.*)", usage))
        bodies = dict(re.findall(r"Function : ([\w$]+)\n(.*?)(?=\n\s*Function : |\Z)", sass, re.S))
        for kern in kernels:
            symbol = next((f for f in functions if f.startswith(f"{kern.function}_kernel")), None)
            if symbol is None:
                continue
            fields = dict(re.findall(r"(\w+):(\d+)", functions[symbol]))
            mma = "IMMA" if kern.precision == "int8" else "HMMA"
            reports.append(KernelReport(kern.name, image.arch, len(re.findall(rf"\b{mma}\.", bodies.get(symbol, ""))),
                                        int(fields.get("REG", 0)), int(fields.get("STACK", 0)),
                                        int(fields.get("LOCAL", 0)), sizes[kern.name], kern.threads, kern.grid))
    return reports


# ------------------------------------------------------------------ the graph: NHWC, then CUTLASS calls

def prepare_nhwc(graph):
    """The CUDA graph for CUTLASS: every convolution NHWC with OHWI weights (Relax's ConvertLayout, which carries
    NHWC through the element-wise operators between them: one transpose at each end), the weights' transposes
    done now, and input channels that are not a multiple of the kernel's alignment (``alignment``) padded (zero
    weights, and the activation padded with zeros by a pad before the convolution; int8 channels that are a
    multiple of 8 are not: their kernel loads 8 at a time). int8: quantize/dequantize
    with zero points of 0 written as the element-wise operators they compute (ConvertLayout carries NHWC through
    those, not through their axis), and a convolution's two int32 bias adds (the bias and its correction) made
    one. Plain Relax: it builds for any target, so the golden outputs check this layout and padding on the build
    host."""
    from edgeq.graph import call_op, rewrite
    from edgeq.graph_passes import dtype_of, fresh_name, precompute_weight_ops
    from edgeq.tvm_env import relax

    # clips as maximum/minimum of a scalar constant first: ConvertLayout carries NHWC through those, not through
    # relax.clip or the TIR calls ONNX Clip with weight bounds imports as
    graph = rewrite(graph, _clip_as_max_min)
    graph = rewrite(graph, _qdq_as_elementwise)
    mod = relax.transform.ConvertLayout({"relax.nn.conv2d": ["NHWC", "OHWI"]})(graph.mod)
    mod = relax.transform.FoldConstant()(mod)  # the transposes of per-channel scales
    graph = precompute_weight_ops(type(graph)(mod, graph.weights))
    graph = rewrite(graph, _one_int32_bias)
    graph = rewrite(graph, _one_scale)
    int8 = any(dtype_of(b.var) == "int8" for b in graph.bindings())
    graph = _int8_projections_as_one(graph) if int8 else _projections_as_one(graph)
    graph = rewrite(graph, _matmul_as_conv)
    graph = rewrite(graph, _depthwise_hwoi)
    if int8:
        graph = rewrite(graph, _float_attention_in_fp16)
        graph = _fp16_before_head_split(graph)
        graph = _float32_after_head_merge(graph)

    def visit(rw, var, value):
        if call_op(value) != "relax.nn.conv2d" or value.attrs.data_layout != "NHWC" or int(value.attrs.groups) != 1:
            return None
        w = rw.weight(value.args[1])
        align = alignment(dtype_of(value.args[0]) or "float16")
        # int8 channels that are a multiple of 8 take 64-bit loads instead (ConvKernel.input_alignment): no pad
        if w is None or w.ndim != 4 or w.shape[3] % align == 0 or w.shape[3] % ALIGNMENT == 0 or w.shape[3] < 3:
            return None
        extra = -w.shape[3] % align
        padded_w = rw.param(fresh_name(rw, f"{value.args[1].name}_c{w.shape[3] + extra}"),
                            np.pad(w, ((0, 0), (0, 0), (0, 0), (0, extra))))
        x = rw.emit(relax.op.nn.pad(rw.new(value.args[0]), [0, 0, 0, 0, 0, 0, 0, extra]))
        return relax.Call(value.op, [x, padded_w], value.attrs)

    return rewrite(graph, visit)


def _depthwise_hwoi(rw, var, value):
    """A depthwise convolution (NHWC, groups = input channels = output channels, a multiple of DEPTHWISE_LANES) with
    its OHWI weights [K, R, S, 1] as HWOI [R, S, K, 1], done now: the channels a depthwise kernel's thread reads for
    one tap are then consecutive. Relax legalizes either layout, so the graph still builds for any target."""
    from edgeq.graph import call_op
    from edgeq.graph_passes import fresh_name, shape_of
    from edgeq.tvm_env import relax

    if call_op(value) != "relax.nn.conv2d":
        return None
    attrs = value.attrs
    groups = int(attrs.groups)
    w = rw.weight(value.args[1])
    xs = shape_of(value.args[0])
    if attrs.data_layout != "NHWC" or attrs.kernel_layout != "OHWI" or groups == 1 or w is None or xs is None:
        return None
    if w.ndim != 4 or w.shape[3] != 1 or w.shape[0] != groups or xs[3] != groups or groups % DEPTHWISE_LANES:
        return None
    hwoi = rw.param(fresh_name(rw, f"{value.args[1].name}_hwoi"), np.ascontiguousarray(np.transpose(w, (1, 2, 0, 3))))
    return relax.op.nn.conv2d(rw.new(value.args[0]), hwoi, strides=attrs.strides, padding=attrs.padding,
                              dilation=attrs.dilation, groups=groups, data_layout="NHWC", kernel_layout="HWOI",
                              out_layout=attrs.out_layout, out_dtype=attrs.out_dtype)


def _matmul_as_conv(rw, var, value):
    """A matrix product by a weight, ``matmul(x [..., K], W [K, N])`` (Gemm's ``transB`` seen through), as the 1x1
    convolution it is: ``reshape(conv2d(reshape(x, [1, 1, M, K]), W^T as OHWI [N, 1, 1, K]), [..., N])`` with M the
    product of x's other axes. Both reshapes are views; ``find_convs`` sees through the second, so a linear layer
    and its epilogue go to the CUTLASS convolution kernel (an implicit GEMM of M x N x K). Left as it is where N
    is not a multiple of 8 (the kernel's output alignment) or x's shape is not static."""
    from edgeq.graph import call_op
    from edgeq.graph_passes import dtype_of, fresh_name, shape_of
    from edgeq.tvm_env import relax

    if call_op(value) != "relax.matmul":
        return None
    w_var, transposed = rw.weight_operand(value)
    w = rw.weight(w_var) if w_var is not None else None
    x = value.args[0]
    xs, out_dtype = shape_of(x), dtype_of(var)
    if w is None or w.ndim != 2 or xs is None or len(xs) < 2 or out_dtype is None:
        return None
    k, n = (w.shape[1], w.shape[0]) if transposed else w.shape
    if xs[-1] != k or n % ALIGNMENT or dtype_of(x) not in ("float32", "float16", "int8"):
        return None
    ohwi = np.ascontiguousarray(w if transposed else w.T).reshape(n, 1, 1, k)
    m = int(np.prod(xs[:-1]))
    flat = rw.emit(relax.op.reshape(rw.new(x), [1, 1, m, k]))
    conv = rw.emit(relax.op.nn.conv2d(flat, rw.param(fresh_name(rw, f"{w_var.name}_ohwi"), ohwi),
                                      data_layout="NHWC", kernel_layout="OHWI", out_dtype=out_dtype))
    return relax.op.reshape(conv, [*xs[:-1], n])


def _into_attention(out, value_of, only_reader, is_weight) -> bool:
    """Is ``out`` read only through a head split into attention's products: reshape to [1, S, H, D], transpose,
    matrix product of two activations (its second operand not what ``is_weight`` says is a weight)?"""
    from edgeq.graph import call_op
    from edgeq.graph_passes import shape_of

    split = only_reader(out)
    turn = only_reader(split) if split is not None else None
    product = only_reader(turn) if turn is not None else None
    shape = shape_of(split) if split is not None else None
    return (call_op(value_of.get(split)) == "relax.reshape" and shape is not None and len(shape) == 4
            and call_op(value_of.get(turn)) == "relax.permute_dims"
            and call_op(value_of.get(product)) == "relax.matmul" and not is_weight(value_of[product].args[1]))


def _as_one(graph, groups: dict, emit_wide):
    """``graph`` with each group of projections computed as one: ``groups`` maps a key (what the projections
    share) to its members, ``(the projection's last var, its width, ...)`` in binding order; at the first member,
    ``emit_wide(rw, key, members)`` emits the wide tensor, and each member becomes a slice of its last axis."""
    from edgeq.graph import rewrite
    from edgeq.graph_passes import shape_of
    from edgeq.tvm_env import relax

    groups = {key: members for key, members in groups.items() if len(members) > 1}
    if not groups:
        return graph
    part_of = {m[0]: (key, i) for key, members in groups.items() for i, m in enumerate(members)}
    merged: dict = {}

    def visit(rw, var, value):
        if var not in part_of:
            return None
        key, i = part_of[var]
        members = groups[key]
        if key not in merged:
            merged[key] = emit_wide(rw, key, members)
        first = sum(m[1] for m in members[:i])
        axis = len(shape_of(var)) - 1
        return relax.op.strided_slice(merged[key], [axis], [first], [first + members[i][1]])

    return rewrite(graph, visit)


def _projections_as_one(graph):
    """The projections of one tensor that feed attention's products, ``matmul(x, W_i) + b_i`` each read through a
    head split (reshape to [1, S, H, D], transpose, matrix product: Q, K and V of a transformer's layer), as one
    ``matmul(x, [W_1 .. W_n]) + [b_1 .. b_n]`` and a slice of its last axis per projection (TensorRT's fused QKV):
    one GEMM of n x the width instead of n launches, each product's output element the same dot product. The
    batched GEMMs read their heads from the wide tensor in place (``_head_view``), so the slices cost nothing.
    Float graphs (an int8 graph's per-token projections: ``_int8_projections_as_one``)."""
    from edgeq.graph import call_op
    from edgeq.graph_passes import dtype_of, fresh_name, shape_of
    from edgeq.tvm_env import relax

    bindings = graph.bindings()
    value_of = {b.var: b.value for b in bindings}
    only_reader = only_reader_of(graph.readers())
    weights = {p: graph.weights[p.name] for p in graph.weight_params}

    def weight_of(expr):  # (W as [K, N], its parameter) of a matmul's second operand, or None
        if expr in weights:
            return weights[expr], expr
        inner = value_of.get(expr)
        if call_op(inner) == "relax.permute_dims" and inner.args[0] in weights and weights[inner.args[0]].ndim == 2:
            return weights[inner.args[0]].T, inner.args[0]
        return None

    groups: dict = {}
    for b in bindings:
        value = b.value
        if call_op(value) != "relax.matmul" or dtype_of(b.var) != "float32":
            continue
        x, found = value.args[0], weight_of(value.args[1])
        add = only_reader(b.var)
        if found is None or found[0].ndim != 2 or found[0].dtype != np.float32 or found[0].shape[1] % ALIGNMENT \
                or call_op(value_of.get(add)) != "relax.add" or shape_of(x) is None:
            continue
        bias = [a for a in value_of[add].args if not a.same_as(b.var)]
        if len(bias) != 1 or bias[0] not in weights or weights[bias[0]].shape != (found[0].shape[1],) \
                or not _into_attention(add, value_of, only_reader, lambda e: weight_of(e) is not None):
            continue
        groups.setdefault(x, []).append((add, found[0].shape[1], found[0], weights[bias[0]], found[1].name))

    def emit_wide(rw, x, members):
        name = "_".join(m[4] for m in members)
        w = rw.param(fresh_name(rw, f"{name}_as_one"), np.concatenate([m[2] for m in members], axis=1))
        bias = rw.param(fresh_name(rw, f"{name}_bias_as_one"), np.concatenate([m[3] for m in members]))
        return rw.emit(relax.op.add(rw.emit(relax.op.matmul(rw.new(x), w)), bias))

    return _as_one(graph, groups, emit_wide)


def _int8_projections_as_one(graph):
    """``_projections_as_one`` for an int8 graph's per-token projections (``quantize_ops``): ``matmul(xq, W_i int8,
    int32) -> float32 -> * s_i (the weight's per-channel scale) -> * rows (the tokens' scales) -> + b_i``, each read
    through a head split into attention's products, with xq and rows shared (Q, K and V of a layer read one
    quantized input): one ``matmul(xq, [W_1 .. W_n])`` with ``[s_1 .. s_n]`` and ``[b_1 .. b_n]``, and a slice of its
    last axis per projection. Every output element goes through the same operations: bit for bit."""
    from edgeq.graph import call_op, const_value
    from edgeq.graph_passes import dtype_of, fresh_name
    from edgeq.tvm_env import relax

    bindings = graph.bindings()
    value_of = {b.var: b.value for b in bindings}
    only_reader = only_reader_of(graph.readers())
    weights = {p: graph.weights[p.name] for p in graph.weight_params}

    def op_of(var):
        return call_op(value_of.get(var)) if var is not None else None

    def other(var, prev):
        args = [a for a in value_of[var].args if not a.same_as(prev)]
        return args[0] if len(args) == 1 else None

    groups: dict = {}
    for b in bindings:
        value = b.value
        if call_op(value) != "relax.matmul" or dtype_of(b.var) != "int32" or value.args[1] not in weights:
            continue
        w = weights[value.args[1]]
        cast = only_reader(b.var)
        if w.ndim != 2 or w.dtype != np.int8 or w.shape[1] % ALIGNMENT or op_of(cast) != "relax.astype" \
                or dtype_of(cast) != "float32":
            continue
        scaled = only_reader(cast)
        s = const_value(other(scaled, cast)) if op_of(scaled) == "relax.multiply" else None
        if s is None or s.dtype != np.float32 or s.size != w.shape[1] or (s.ndim and s.shape[-1] != w.shape[1]):
            continue
        by_rows = only_reader(scaled)
        rows = other(by_rows, scaled) if op_of(by_rows) == "relax.multiply" else None
        add = only_reader(by_rows) if rows is not None else None
        bias = other(add, by_rows) if op_of(add) == "relax.add" else None
        if not isinstance(rows, relax.Var) or rows in weights or bias not in weights \
                or weights[bias].shape != (w.shape[1],) or not _into_attention(add, value_of, only_reader, weights.__contains__):
            continue
        groups.setdefault((value.args[0], rows), []).append(
            (add, w.shape[1], w, s.reshape(-1), weights[bias], value.args[1].name))

    def emit_wide(rw, key, members):
        x, rows = key
        name = "_".join(m[5] for m in members)
        w = rw.param(fresh_name(rw, f"{name}_as_one"), np.concatenate([m[2] for m in members], axis=1))
        acc = rw.emit(relax.op.matmul(rw.new(x), w, out_dtype="int32"))
        scaled = rw.emit(relax.op.multiply(rw.emit(relax.op.astype(acc, "float32")),
                                           rw.const(np.concatenate([m[3] for m in members]))))
        bias = rw.param(fresh_name(rw, f"{name}_bias_as_one"), np.concatenate([m[4] for m in members]))
        return rw.emit(relax.op.add(rw.emit(relax.op.multiply(scaled, rw.new(rows))), bias))

    return _as_one(graph, groups, emit_wide)


def _fp16_before_head_split(graph):
    """In an int8 graph, attention's fp16 operands cast after the head split, ``astype(permute_dims(reshape(
    strided_slice(T))), fp16)`` (``_float_attention_in_fp16``; T the float32 output of the projections computed as one,
    ``_int8_projections_as_one``), cast before it: ``permute_dims(reshape(strided_slice(astype(T, fp16))))``, one cast
    of T for all its slices. The cast then fuses into the kernel that makes T, which writes fp16, and the batched
    GEMMs read their heads from it in place (``_head_view``), as in an fp16 graph. Exact (a cast commutes with moving
    values). Only where every reader of T is such a chain."""
    from edgeq.graph import call_op, rewrite
    from edgeq.graph_passes import dtype_of, shape_of
    from edgeq.tvm_env import relax

    bindings = graph.bindings()
    value_of = {b.var: b.value for b in bindings}
    readers = graph.readers()
    only_reader = only_reader_of(readers)

    def chain(var):
        """[slice, reshape, permute, cast] from a reader of T, or None."""
        out = [var]
        for op in ("relax.reshape", "relax.permute_dims", "relax.astype"):
            nxt = only_reader(out[-1])
            if call_op(value_of.get(nxt)) != op:
                return None
            out.append(nxt)
        return out if dtype_of(out[-1]) == "float16" else None

    cast_of: dict = {}  # T -> its chains
    for b in bindings:
        if dtype_of(b.var) != "float32" or shape_of(b.var) is None or len(shape_of(b.var)) != 3:
            continue
        found = []
        for r in readers.get(b.var, []):
            c = chain(r) if r is not None and _last_axis_slice(r, value_of) is not None else None
            if c is None:
                found = []
                break
            found.append(c)
        if len(found) > 1:
            cast_of[b.var] = found
    if not cast_of:
        return graph
    moved = {c[i]: (t, i) for t, chains in cast_of.items() for c in chains for i in range(4)}
    halves: dict = {}

    def visit(rw, var, value):
        if var in cast_of:
            out = rw.emit(rw.new(value))
            halves[var] = rw.emit(relax.op.astype(out, "float16"))
            return out
        if var not in moved:
            return None
        t, i = moved[var]
        if i == 0:  # the slice, of the fp16 T
            return relax.Call(value.op, [halves[t], *value.args[1:]], value.attrs)
        if i == 3:  # the cast: its input is fp16 already
            return rw.new(value.args[0])
        return None

    return rewrite(graph, visit)


def _float32_after_head_merge(graph):
    """In an int8 graph, attention's context cast to float32 before its heads are merged, ``reshape(permute_dims(
    astype(c, float32), [0, 2, 1, 3]))`` with c the fp16 product P V (``_float_attention_in_fp16``), cast after:
    ``astype(reshape(permute_dims(c)), float32)``. The batched GEMM then writes the heads merged in place
    (``_head_view``, as in an fp16 graph), and the cast fuses into the per-token quantize that reads it (the token
    scales read the fp16 context themselves: ``pipeline.row_scales_in_one_kernel``). Exact."""
    from edgeq.graph import call_op, rewrite
    from edgeq.graph_passes import dtype_of
    from edgeq.tvm_env import relax

    bindings = graph.bindings()
    value_of = {b.var: b.value for b in bindings}
    only_reader = only_reader_of(graph.readers())
    found: dict = {}  # the cast -> the reshape after its permute
    for b in bindings:
        value = b.value
        if call_op(value) != "relax.astype" or dtype_of(b.var) != "float32" or dtype_of(value.args[0]) != "float16":
            continue
        turn = only_reader(b.var)
        merge = only_reader(turn) if turn is not None else None
        if call_op(value_of.get(turn)) != "relax.permute_dims" or call_op(value_of.get(merge)) != "relax.reshape" \
                or value_of[turn].attrs.axes is None \
                or tuple(int(a) for a in value_of[turn].attrs.axes) != (0, 2, 1, 3):
            continue
        found[b.var] = merge
    if not found:
        return graph
    merges = set(found.values())

    def visit(rw, var, value):
        if var in found:  # the cast: the fp16 product, until the merge (the permute reads it as it is)
            return rw.new(value.args[0])
        if var in merges:
            return relax.op.astype(rw.emit(rw.new(value)), "float32")
        return None

    return rewrite(graph, visit)


def _float_attention_in_fp16(rw, var, value):
    """In an int8 graph, a float32 product of two activations (attention's Q K^T and P V, which the quantizer keeps
    in float) in fp16 with fp32 accumulation, as TensorRT runs the layers an int8 engine leaves in float: ``float32(
    fp16(matmul(fp16(a), fp16(b), fp32 out)))``, the batched GEMM ``find_convs`` claims (of any alignment: a
    window's 49 tokens load one element at a time). Where the batch axes differ, the product stays as it is."""
    from edgeq.graph import call_op
    from edgeq.graph_passes import dtype_of, shape_of
    from edgeq.tvm_env import relax

    if call_op(value) != "relax.matmul" or rw.weight_operand(value)[0] is not None:
        return None
    a, b = value.args
    sa, sb = shape_of(a), shape_of(b)
    if dtype_of(var) != "float32" or dtype_of(a) != "float32" or dtype_of(b) != "float32" or sa is None or sb is None:
        return None
    if len(sa) != len(sb) or len(sa) < 2 or tuple(sa[:-2]) != tuple(sb[:-2]):
        return None
    a16 = rw.emit(relax.op.astype(rw.new(a), "float16"))
    b16 = rw.emit(relax.op.astype(rw.new(b), "float16"))
    product = rw.emit(relax.op.matmul(a16, b16, out_dtype="float32"))
    return relax.op.astype(rw.emit(relax.op.astype(product, "float16")), "float32")


def _qdq_as_elementwise(rw, var, value):
    """int8 quantize/dequantize with a constant scale and zero points of 0 as what TVM legalizes them to:
    ``int8(clamp(round(x / s), -128, 127))`` and ``float32(q) * s`` (a per-channel scale along its axis)."""
    from edgeq.graph import call_op
    from edgeq.graph_passes import shape_of
    from edgeq.tvm_env import relax

    op = call_op(value)
    if op not in ("relax.quantize", "relax.dequantize"):
        return None
    x, scale, zp = value.args
    s, z = rw.static_value(scale), rw.static_value(zp)
    shape = shape_of(x)
    if s is None or z is None or np.any(z != 0) or shape is None:
        return None
    if s.size > 1:
        bshape = [1] * len(shape)
        bshape[int(value.attrs.axis) % len(shape)] = s.size
        s = s.reshape(bshape)
    else:
        s = s.reshape(())
    s_const = relax.const(np.asarray(s, np.float32), "float32")
    if op == "relax.dequantize":
        if str(value.attrs.out_dtype) != "float32":
            return None
        return relax.op.multiply(rw.emit(relax.op.astype(rw.new(x), "float32")), s_const)
    if str(value.attrs.out_dtype) != "int8" or s.size != 1:
        return None
    v = rw.emit(relax.op.round(rw.emit(relax.op.divide(rw.new(x), s_const))))
    v = rw.emit(relax.op.minimum(rw.emit(relax.op.maximum(v, relax.const(-128.0, "float32"))),
                                 relax.const(127.0, "float32")))
    return relax.op.astype(v, "int8")


def _one_scale(rw, var, value):
    """``(x * a) * b`` with float32 per-channel constants or weights ``a`` and ``b`` (a dequantize's scale and a
    BatchNorm's, which edgeq folds after quantization) as ``x * (a * b)``, for an int8 convolution's epilogue."""
    from edgeq.graph import call_op
    from edgeq.graph_passes import fresh_name
    from edgeq.tvm_env import relax

    if call_op(value) != "relax.multiply" or not isinstance(value.args[0], relax.Var):
        return None
    inner = rw.value(value.args[0])
    b = rw.static_value(value.args[1])
    if call_op(inner) != "relax.multiply" or b is None or b.dtype != np.float32 or rw.uses(value.args[0]) != 1:
        return None
    a = rw.static_value(inner.args[1])
    if a is None or a.dtype != np.float32 or call_op(rw.value(inner.args[0])) != "relax.astype":
        return None
    try:
        merged = np.multiply(a, b, dtype=np.float32)
    except ValueError:
        return None
    if merged.ndim > 4 or merged.size != max(a.size, b.size):
        return None
    return relax.op.multiply(rw.new(inner.args[0]), rw.param(fresh_name(rw, "requant_scale"), merged))


def _one_int32_bias(rw, var, value):
    """``(x + a) + b`` with int32 weights ``a`` and ``b`` of one shape (a convolution's bias correction and its
    bias) as ``x + (a + b)``."""
    from edgeq.graph import call_op
    from edgeq.graph_passes import fresh_name
    from edgeq.tvm_env import relax

    if call_op(value) != "relax.add" or not isinstance(value.args[0], relax.Var):
        return None
    inner = rw.value(value.args[0])
    b = rw.weight(value.args[1])
    if call_op(inner) != "relax.add" or b is None or b.dtype != np.int32 or rw.uses(value.args[0]) != 1:
        return None
    a = rw.weight(inner.args[1])
    if a is None or a.dtype != np.int32 or a.shape != b.shape:
        return None
    merged = rw.param(fresh_name(rw, f"{value.args[1].name}_merged"), (a.astype(np.int64) + b).astype(np.int32))
    return relax.op.add(rw.new(inner.args[0]), merged)


def _clip_as_max_min(rw, var, value):
    """relax.clip with immediate bounds, and TIR maximum/minimum calls with a one-element static bound, as
    ``relax.maximum``/``relax.minimum`` of a 0-d constant (the same values)."""
    from edgeq.graph import call_op
    from edgeq.graph_passes import dtype_of
    from edgeq.tvm_env import relax, tvm

    op = call_op(value)
    if op == "relax.clip" and all(isinstance(a, (tvm.tirx.IntImm, tvm.tirx.FloatImm)) for a in value.args[1:]):
        dtype = dtype_of(value.args[0]) or "float32"
        low, high = (relax.const(float(a.value), dtype) for a in value.args[1:])
        return relax.op.minimum(rw.emit(relax.op.maximum(rw.new(value.args[0]), low)), high)
    if op != "relax.call_tir" or not isinstance(value.args[1], relax.Tuple) or len(value.args[1].fields) != 2:
        return None
    name = value.args[0].name_hint
    tir_op = relax.op.maximum if name.startswith("maximum") else relax.op.minimum if name.startswith("minimum") else None
    bound = rw.static_value(value.args[1].fields[1])
    if tir_op is None or bound is None or bound.size != 1:
        return None
    dtype = dtype_of(value.args[1].fields[0]) or "float32"
    return tir_op(rw.new(value.args[1].fields[0]), relax.const(np.asarray(bound, dtype).reshape(()), dtype))


@dataclasses.dataclass(frozen=True)
class Claimed:
    """A convolution chain the CUTLASS kernel took: its kernel, and the Relax variables of its operands."""

    kernel: ConvKernel
    output: object  # the chain's last variable: its binding becomes the call
    x: object
    w: object
    bias: object
    residual: object | None
    chain: tuple  # the chain's other variables, from the conv2d on: their bindings go
    shapes: dict  # the per-channel operands' shapes as the graph holds them: {"bias": (1, 1, 1, K), ...}
    scale: object = None  # int8: the per-channel float32 scale and shift (a constant or a weight; shift may be None)
    shift: object = None
    post: object = None  # int8: the per-channel multiplier after the clamps (``ConvKernel.post``)
    y_in: object = None  # ``ConvKernel.out_in_place``: the tensor the kernel writes its channels of, as it comes in
    up_in: object = None  # ``ConvKernel.up_view``: the tensor its upsampled copy goes into, as it comes in
    token: object = None  # ``TokenLinearKernel``: the per-token scales ([..., M, 1], computed at run time)

    def operands(self) -> list:
        """The Relax arguments of the kernel's call, in ``kernel_operands`` order (without y)."""
        from edgeq.tvm_env import relax

        residual = [self.residual] if self.residual is not None else []
        if isinstance(self.kernel, GemmKernel):
            return [self.x, self.w]
        k = self.kernel.problem.k
        if isinstance(self.kernel, TokenLinearKernel):
            bias = self.bias if self.bias is not None else relax.const(np.zeros(k, np.float32), "float32")
            return [self.x, self.w, self.scale, self.token, bias] + residual
        if self.kernel.precision != "int8":
            bias = self.bias if self.bias is not None else relax.const(np.zeros(k, np.float16), "float16")
            return [self.x, self.w, bias] + residual
        bias = self.bias if self.bias is not None else relax.const(np.zeros(k, np.int32), "int32")
        shift = self.shift if self.shift is not None else relax.const(np.zeros(k, np.float32), "float32")
        post = [self.post] if self.kernel.post else []
        if isinstance(self.kernel, DepthwiseKernel):
            return [self.x, self.w, bias, self.scale, shift] + post + residual
        channel = relax.const(np.arange(k, dtype=np.float32), "float32")
        return [self.x, self.w, bias, self.scale, shift] + post + [channel] + residual


def _const_scalar(expr, value_of=None) -> float | None:
    """A one-element constant's value, also behind a variable bound to an astype of one (how ToMixedPrecision
    leaves a clip's bounds)."""
    from edgeq.graph import call_op, const_value

    if value_of is not None and expr in value_of and call_op(value_of[expr]) == "relax.astype":
        expr = value_of[expr].args[0]
    value = const_value(expr)
    return float(value.reshape(-1)[0]) if value is not None and value.size == 1 else None


def main_index(main) -> tuple[list, dict, dict, set]:
    """What a pass matching chains in ``main`` looks up: its bindings in order, {var: bound value}, {var: the vars
    of the bindings that read it, None for main's output}, and its weight parameters."""
    bindings = [b for block in main.body.blocks for b in block.bindings]
    value_of = {b.var: b.value for b in bindings}
    readers: dict = {}
    for b in bindings:
        for v in set(_free_vars(b.value)):
            readers.setdefault(v, []).append(b.var)
    for v in _free_vars(main.body.body):
        readers.setdefault(v, []).append(None)
    return bindings, value_of, readers, set(main.params[int(main.attrs["num_input"]):])


def only_reader_of(readers: dict):
    """``only_reader(var)`` over ``readers`` ({var: the vars of the bindings that read it, None for the function's
    output}: ``main_index``'s or ``Graph.readers``): the one binding that reads ``var``, None where several do or
    the output does."""
    def only_reader(var):
        r = readers.get(var, [])
        return r[0] if len(r) == 1 and r[0] is not None else None
    return only_reader


def find_convs(main, sm_count: int, smem_per_block: int) -> tuple[list[Claimed], list[dict]]:
    """The fp16 chains ``conv2d(NHWC, OHWI, fp32 out) -> astype fp16 -> + bias -> [+ residual] -> [relu | relu6 | silu]
    -> [astype float32]``
    of ``main`` whose intermediate values have no other reader, as kernels; and the conv2d calls left out, each
    with why (for the manifest)."""
    from edgeq.graph import call_op
    from edgeq.graph_passes import dtype_of, shape_of

    bindings, value_of, readers, params = main_index(main)

    only_reader = only_reader_of(readers)

    def follow(chain, k):
        """The only reader of ``chain[-1]``, past reshapes that keep K channels last (views: ``_matmul_as_conv``'s
        back to the matrix product's shape), which join the chain."""
        nxt = only_reader(chain[-1])
        while call_op(value_of.get(nxt)) == "relax.reshape" and (shape_of(nxt) or [None])[-1] == k:
            chain.append(nxt)
            nxt = only_reader(nxt)
        return nxt

    claimed, left, taken = [], [], set()
    for b in bindings:
        value = b.value
        found = None
        if call_op(value) == "relax.matmul":  # what _matmul_as_conv left a matrix product: attention's, batched
            found = _batched_gemm(b, value_of, only_reader, readers, params, sm_count, smem_per_block,
                                  f"l{len(claimed)}")
        elif call_op(value) != "relax.nn.conv2d":
            continue
        elif dtype_of(value.args[0]) == "int8":
            found = _int8_chain(b, value_of, only_reader, follow, readers, params, sm_count, smem_per_block,
                                f"l{len(claimed)}", taken)
        if found is not None:
            if isinstance(found, str):
                left.append({"conv": b.var.name, "why": found})
            else:
                claimed.append(found)
                taken.update(found.chain)
            continue
        attrs = value.attrs
        why = None
        x, w = value.args
        xs, ws = shape_of(x), shape_of(w)
        depthwise = _depthwise(attrs, xs, ws)
        groups = int(attrs.groups)
        grouped = (not depthwise and attrs.data_layout == "NHWC" and attrs.kernel_layout == "OHWI" and groups > 1
                   and xs is not None and ws is not None and xs[3] == ws[3] * groups)
        if attrs.data_layout != "NHWC" or (attrs.kernel_layout != "OHWI" or groups != 1) and not (depthwise or grouped):
            why = f"{attrs.data_layout}/{attrs.kernel_layout}, groups {groups}"
        elif dtype_of(b.var) != "float32" or dtype_of(x) != "float16":
            why = "not fp16 with fp32 accumulation"
        elif w not in params:
            why = "weights computed at run time"
        pads = [int(p) for p in attrs.padding]
        if why is None and (pads[0] != pads[2] or pads[1] != pads[3]):
            why = "asymmetric padding"
        k, kr, ks = (ws[2], ws[0], ws[1]) if depthwise else (ws[0], ws[1], ws[2]) if ws is not None else (0, 0, 0)
        if why is None and (xs is None or ws is None or (ws[3] % 2 if grouped else xs[3] % ALIGNMENT) or k % ALIGNMENT):
            why = "channels per group odd, or output channels not a multiple of 8" if grouped else \
                "channels not a multiple of 8"
        chain = [b.var]
        cast = follow(chain, k) if why is None else None
        mixed = (_float32_epilogue(chain, cast, k, value_of, only_reader, params, taken)
                 if why is None and not (depthwise or grouped) else None)
        if why is None and mixed is None and (cast is None or call_op(value_of[cast]) != "relax.astype"
                                              or str(value_of[cast].attrs.dtype) != "float16"):
            why = "no fp16 cast after it"
        if why is not None:
            left.append({"conv": b.var.name, "why": why})
            continue
        problem = Conv2dProblem(xs[0], xs[1], xs[2], xs[3], k, kr, ks, (pads[0], pads[1]),
                                tuple(int(v) for v in attrs.strides), tuple(int(d) for d in attrs.dilation),
                                c_real=xs[3] - _channels_padded(x, value_of),
                                groups=k if depthwise else groups if grouped else 1)
        if mixed is not None:  # an fp16 layer of an int8 graph: float32 bias and residual, float32 out (the
            # residual added before the bias, CUTLASS's order: a float32 rounding from the graph's)
            bias, residual, chain = mixed
            kernel = ConvKernel(f"l{len(claimed)}", problem, split_k(problem, choose_tile(
                problem, sm_count, smem_per_block), sm_count), residual=True, float_out=True, float_bias=True)
            claimed.append(Claimed(kernel, chain[-1], x, w, bias, residual, tuple(chain[:-1]),
                                   {"bias": tuple(shape_of(bias)), **_output_shape(chain[-1], problem)}))
            taken.update(chain)
            continue
        chain.append(cast)
        # the bias: a per-channel weight added after the cast; a convolution without one (DenseNet's, into its
        # concatenations) gets zeros, and what follows it is matched as after a bias
        add = follow(chain, k)
        bias = None
        if add is not None and call_op(value_of[add]) == "relax.add":
            other = [a for a in value_of[add].args if not a.same_as(chain[-1])]
            shape = shape_of(other[0]) if other and other[0] in params else None
            if shape is not None and int(np.prod(shape)) == k and shape[-1] == k:
                bias = other[0]
                chain.append(add)
        residual, activation = None, "identity"
        nxt = only_reader(chain[-1])
        if nxt is not None and nxt in taken:  # another chain's residual add: this output is its residual
            nxt = None
        if nxt is not None and call_op(value_of[nxt]) == "relax.add" and not grouped:  # (its epilogue's source is
            # the bias)
            other = [a for a in value_of[nxt].args if not a.same_as(chain[-1])]
            if other and shape_of(other[0]) == shape_of(chain[-1]) and dtype_of(other[0]) == "float16":
                residual = other[0]
                chain.append(nxt)
                nxt = only_reader(nxt)
        if nxt is not None and call_op(value_of[nxt]) == "relax.nn.relu":
            activation = "relu"
            chain.append(nxt)
        elif nxt is not None and call_op(value_of[nxt]) == "relax.maximum" and \
                _const_scalar(value_of[nxt].args[1], value_of) == 0.0:
            activation = "relu"
            chain.append(nxt)
            after = only_reader(nxt)
            if after is not None and call_op(value_of[after]) == "relax.minimum" and \
                    _const_scalar(value_of[after].args[1], value_of) == 6.0:
                activation = "relu6"
                chain.append(after)
        elif nxt is not None and call_op(value_of[nxt]) == "relax.nn.gelu" and not depthwise:
            activation = "gelu"
            chain.append(nxt)
        elif nxt is None:
            silu = _silu_of(chain[-1], readers, value_of, only_reader)
            gelu = _gelu_of(chain[-1], readers, value_of, only_reader) if not depthwise else None
            if silu is not None:
                activation = "silu"
                chain += silu
            elif gelu is not None:
                activation = "gelu"
                chain += gelu
        # a residual added after the activation (YOLO's bottleneck, x + SiLU(conv(x))): edgeq's epilogue
        # (``ConvKernel.residual_after``)
        residual_after = False
        after = only_reader(chain[-1]) if residual is None and activation != "identity" and not depthwise \
            and not grouped else None
        if after is not None and after not in taken and call_op(value_of[after]) == "relax.add":
            other = [a for a in value_of[after].args if not a.same_as(chain[-1])]
            if other and shape_of(other[0]) == shape_of(chain[-1]) and dtype_of(other[0]) == "float16":
                residual, residual_after = other[0], True
                chain.append(after)
        # the graph's cast of the output to float32 (a classifier's logits): the kernel writes float32 unrounded
        to_float = only_reader(chain[-1])
        float_out = (residual is None and not depthwise and not grouped and to_float is not None and to_float not in taken
                     and call_op(value_of[to_float]) == "relax.astype" and dtype_of(to_float) == "float32")
        if float_out:
            chain.append(to_float)
            # a float32 residual added to it (a transformer's residual stream, which ToMixedPrecision keeps in
            # float32): in the epilogue, whose source has the output's type. Before the bias there, after it in the
            # graph: only without an activation between them
            after = only_reader(to_float)
            if activation == "identity" and after is not None and after not in taken \
                    and call_op(value_of[after]) == "relax.add":
                other = [a for a in value_of[after].args if not a.same_as(to_float)]
                if other and shape_of(other[0]) == shape_of(to_float) and dtype_of(other[0]) == "float32":
                    residual = other[0]
                    chain.append(after)
        if grouped:
            tile = group_tile(problem, sm_count, smem_per_block)
            kernel = GroupConvKernel(f"l{len(claimed)}", problem, tile, activation) if tile else None
            if kernel is None or kernel.work > MAX_GROUP_WORK:
                why = (f"no tile takes {k // groups} output channels a group" if kernel is None else
                       f"groups of {ws[3]} channels: {kernel.work:g}x the useful work on the tensor cores (over "
                       f"{MAX_GROUP_WORK}x: zeros of the other groups)")
                left.append({"conv": b.var.name, "why": why})
                continue
        elif depthwise:
            if _output_shape(chain[-1], problem):
                left.append({"conv": b.var.name, "why": "a depthwise output seen through a reshape"})
                continue
            kernel = DepthwiseKernel(f"l{len(claimed)}", problem, None, activation, residual is not None)
        else:
            tile = choose_tile(problem, sm_count, smem_per_block)
            kernel = ConvKernel(f"l{len(claimed)}", problem, tile if residual_after else split_k(problem, tile, sm_count),
                                activation, residual is not None, float_out=float_out, residual_after=residual_after)
        claimed.append(Claimed(kernel, chain[-1], x, w, bias, residual, tuple(chain[:-1]),
                               {"bias": tuple(shape_of(bias)) if bias is not None else (k,),
                                **_output_shape(chain[-1], problem)}))
        taken.update(chain)
    return [_read_in_place(c, value_of) for c in claimed], left


def _float32_epilogue(chain, add, k, value_of, only_reader, params, taken) -> tuple | None:
    """Where an fp16 product with float32 out (``chain``: the conv2d and its views; an fp16 layer of an int8 graph,
    ``quantize_ops``) is read by ``add`` of a float32 bias [K] (a weight) and that by an add of a float32 residual
    of its shape (a transformer's residual stream): (the bias, the residual, the chain through both adds); else
    None."""
    from edgeq.graph import call_op
    from edgeq.graph_passes import dtype_of, shape_of

    def operand(var, prev):
        args = [a for a in value_of[var].args if not a.same_as(prev)]
        return args[0] if len(args) == 1 else None

    if dtype_of(chain[-1]) != "float32" or add is None or add in taken or call_op(value_of[add]) != "relax.add":
        return None
    bias = operand(add, chain[-1])
    shape = shape_of(bias) if bias is not None and bias in params and dtype_of(bias) == "float32" else None
    if shape is None or int(np.prod(shape)) != k or shape[-1] != k:
        return None
    nxt = only_reader(add)
    if nxt is None or nxt in taken or call_op(value_of[nxt]) != "relax.add":
        return None
    residual = operand(nxt, add)
    if residual is None or dtype_of(residual) != "float32" or shape_of(residual) != shape_of(add) \
            or any(residual.same_as(v) for v in chain):
        return None
    return bias, residual, [*chain, add, nxt]


def _read_in_place(c: Claimed, value_of) -> Claimed:
    """A CUTLASS convolution whose input is a channel slice (``strided_slice`` on the last axis of an NHWC tensor,
    step 1; ``pipeline.splits_as_slices``) reads those channels of the wider tensor in place (``x_view``) where the
    first channel and the tensor's channels keep its loads aligned; else ``c`` as it is."""
    from edgeq.graph_passes import shape_of

    kern = c.kernel
    found = _last_axis_slice(c.x, value_of) if type(kern) is ConvKernel else None
    if found is None or len(shape_of(found[0])) != 4:
        return c
    t, first, _ = found
    channels = shape_of(t)[3]
    viewed = dataclasses.replace(kern, x_view=(first, channels))
    if first + kern.problem.c > channels or first % viewed.input_alignment or channels % viewed.input_alignment:
        return c
    return dataclasses.replace(c, kernel=viewed, x=t)


def _depthwise(attrs, xs, ws) -> bool:
    """Whether a conv2d is one ``DepthwiseKernel`` takes: NHWC, HWOI weights [R, S, K, 1] (``_depthwise_hwoi``),
    groups = input channels = output channels."""
    groups = int(attrs.groups)
    return (attrs.data_layout == "NHWC" and attrs.kernel_layout == "HWOI" and groups > 1 and xs is not None
            and ws is not None and ws[3] == 1 and ws[2] == groups == xs[3])


def _silu_of(var, readers, value_of, only_reader) -> list | None:
    """[sigmoid, multiply] where ``var``'s two readers are ``s = sigmoid(var)`` and ``var * s`` (SiLU as exporters
    write it, x * sigmoid(x)), else None."""
    from edgeq.graph import call_op

    rs = readers.get(var, [])
    if len(rs) != 2 or None in rs:
        return None
    sig = next((r for r in rs if call_op(value_of[r]) == "relax.sigmoid"), None)
    mul = next((r for r in rs if call_op(value_of[r]) == "relax.multiply"), None)
    if sig is None or mul is None or not _same(only_reader(sig), mul):
        return None
    args = value_of[mul].args
    if not ((args[0].same_as(var) and args[1].same_as(sig)) or (args[0].same_as(sig) and args[1].same_as(var))):
        return None
    return [sig, mul]


def _gelu_of(var, readers, value_of, only_reader) -> list | None:
    """The bindings of GELU's erf form on ``var`` (x * 0.5 * (1 + erf(x / sqrt(2))) as exporters write it: PyTorch's
    ``nn.GELU``, BERT's FFN), else None: ``var``'s two readers are the erf branch, ``x * (1/sqrt(2))`` or ``x /
    sqrt(2)`` -> erf -> + 1, and the half, ``x * 0.5`` times that branch or ``x`` times it then times 0.5."""
    from edgeq.graph import call_op

    def scalar(expr, want):
        got = _const_scalar(expr, value_of)
        return got is not None and abs(got - want) <= 1e-3 * abs(want)

    def other(call, this):
        args = [a for a in value_of[call].args if not a.same_as(this)]
        return args[0] if len(args) == 1 else None

    def reader(v, op):
        r = only_reader(v)
        return r if r is not None and call_op(value_of[r]) == op else None

    rs = readers.get(var, [])
    if len(rs) != 2 or None in rs:
        return None
    for scaled, half in (rs, rs[::-1]):
        op = call_op(value_of[scaled])
        if not (op == "relax.multiply" and scalar(other(scaled, var), 1 / math.sqrt(2))
                or op == "relax.divide" and value_of[scaled].args[0].same_as(var)
                and scalar(value_of[scaled].args[1], math.sqrt(2))):
            continue
        erf = reader(scaled, "relax.erf")
        one_plus = reader(erf, "relax.add") if erf is not None else None
        if one_plus is None or not scalar(other(one_plus, erf), 1.0) or call_op(value_of[half]) != "relax.multiply":
            continue
        if scalar(other(half, var), 0.5):  # (x * 0.5) * (1 + erf)
            final = reader(half, "relax.multiply")
            if final is not None and _same(only_reader(one_plus), final) and other(final, half).same_as(one_plus):
                return [scaled, erf, one_plus, half, final]
        elif other(half, var) is not None and other(half, var).same_as(one_plus):  # (x * (1 + erf)) * 0.5
            final = reader(half, "relax.multiply")
            if final is not None and scalar(other(final, half), 0.5):
                return [scaled, erf, one_plus, half, final]
    return None


def _batched_gemm(b, value_of, only_reader, readers, params, sm_count: int, smem_per_block: int,
                  name: str) -> Claimed | str:
    """A matrix product ``_matmul_as_conv`` left (the second operand an activation: attention's Q K^T and P V) as
    one batched GEMM kernel, ``matmul(fp16 [..., M, K], fp16 [..., K, N], fp32 out) -> astype fp16``; or why it is
    left to dlight."""
    from edgeq.graph import call_op
    from edgeq.graph_passes import dtype_of, shape_of

    value = b.value
    a, w = value.args
    wv = value_of[w].args[0] if call_op(value_of.get(w)) == "relax.permute_dims" else w
    a_shape, w_shape, out = shape_of(a), shape_of(w), shape_of(b.var)
    if wv in params:
        if w_shape is not None and len(w_shape) == 2 and out is not None and out[-1] % ALIGNMENT:
            return "output features not a multiple of 8"
        return "a matrix product with a weight of rank > 2 or a dynamic shape"
    if dtype_of(a) != "float16" or dtype_of(w) != "float16" or dtype_of(b.var) != "float32":
        return "a product of two activations not fp16 with fp32 accumulation (int8 graphs keep attention in float32)"
    if a_shape is None or w_shape is None or len(a_shape) != len(w_shape) or len(a_shape) < 2 \
            or tuple(a_shape[:-2]) != tuple(w_shape[:-2]):
        return "a product of two activations with broadcast or dynamic batch axes"
    (m, k), n = a_shape[-2:], w_shape[-1]
    cast = only_reader(b.var)
    if call_op(value_of.get(cast)) != "relax.astype" or str(value_of[cast].attrs.dtype) != "float16":
        return "no fp16 cast after it"
    chain, alpha = [b.var, cast], 1.0
    scale = only_reader(cast)  # x a scalar constant (attention's 1/sqrt(d)): in the epilogue, before the rounding
    if call_op(value_of.get(scale)) == "relax.multiply" and value_of[scale].args[0].same_as(cast):
        c = _const_scalar(value_of[scale].args[1], value_of)
        if c is not None:
            chain, alpha = [*chain, scale], c
    problem = GemmProblem(int(np.prod(a_shape[:-2])) if len(a_shape) > 2 else 1, m, n, k)
    if problem.batch > 65535:  # one batch per blockIdx.z
        return "a batched matrix product of more than 65535 matrices"
    # the heads' transposes around attention's products, read and written in place (no kernel of their own)
    views, dropped = {}, []
    for operand, which, axes in ((a, "a", [(0, 2, 1, 3)]), (w, "w", [(0, 2, 1, 3), (0, 2, 3, 1)])):
        seen = _head_view(operand, value_of, only_reader, b.var)
        if seen is not None and seen[2] in axes:
            views[which] = seen
            dropped += [operand, *seen[4]]
    back = only_reader(chain[-1])  # the context's heads back to [1, S, H, D]: written there
    seen = _head_view(back, value_of, only_reader, None) if back is not None else None
    if seen is not None and seen[2] == (0, 2, 1, 3):
        s_, h_, d_ = shape_of(back)[1:]
        views["y"] = (back, (h_ * d_, d_), seen[2])
        chain.append(back)
    # the graph's cast of the product to float32 (attention's scores, before the softmax ToMixedPrecision keeps in
    # float32): written as float32, unrounded
    to_float = only_reader(chain[-1])
    float_out = to_float is not None and call_op(value_of[to_float]) == "relax.astype" \
        and dtype_of(to_float) == "float32" and call_op(value_of.get(only_reader(to_float))) == "relax.nn.softmax"
    if float_out:
        chain.append(to_float)
    quantize = None if float_out else _quantize_after(chain[-1], value_of, only_reader, readers)
    if quantize is not None:  # the context quantized with one scale (the output projection's per-tensor input)
        chain += quantize[0]
        quantize = quantize[1]
    kernel = GemmKernel(name, problem, choose_tile(problem, sm_count, smem_per_block), alpha, float_out=float_out,
                        a_view=views["a"][1] if "a" in views else None,
                        b_view=views["w"][1] if "w" in views else None,
                        y_view=views["y"][1] if "y" in views else None,
                        b_column_major="w" in views and views["w"][2] == (0, 2, 3, 1),
                        a_offset=views["a"][3] if "a" in views else 0, b_offset=views["w"][3] if "w" in views else 0,
                        quantize=quantize)
    kernel = dataclasses.replace(kernel, tile=gemm_tile(kernel.tile, kernel.alignment))
    a = views["a"][0] if "a" in views else a
    w = views["w"][0] if "w" in views else w
    shapes = {"a": tuple(shape_of(a)), "w": tuple(shape_of(w)), "y": tuple(shape_of(chain[-1]))}
    return Claimed(kernel, chain[-1], a, w, None, None, tuple(dropped) + tuple(chain[:-1]), shapes)


def quantize_tail(divide, value_of, readers):
    """((rounded, low, high), the int8 cast, (lo, hi)) where ``divide`` is read only by ``round``, then
    ``maximum(., lo)``, ``minimum(., hi)`` and ``astype(int8)``, each by the next only, lo and hi constants in
    [-128, 127]; else None."""
    from edgeq.graph import call_op
    from edgeq.graph_passes import dtype_of

    def only_reader(var, op):
        r = readers.get(var, [])
        return r[0] if len(r) == 1 and r[0] is not None and call_op(value_of[r[0]]) == op else None

    rounded = only_reader(divide, "relax.round")
    low = only_reader(rounded, "relax.maximum") if rounded is not None else None
    high = only_reader(low, "relax.minimum") if low is not None else None
    cast = only_reader(high, "relax.astype") if high is not None else None
    if cast is None or dtype_of(cast) != "int8":
        return None
    lo, hi = _const_scalar(value_of[low].args[1]), _const_scalar(value_of[high].args[1])
    if lo is None or hi is None or not -128 <= lo <= hi <= 127:
        return None
    return (rounded, low, high), cast, (lo, hi)


def _quantize_after(var, value_of, only_reader, readers) -> tuple | None:
    """([the variables], (divisor, lo, hi)) where fp16 ``var`` is read only by ``[reshape ->] astype(float32) ->
    divide(c)`` and then the int8 tail ``quantize_tail`` matches (round, maximum(lo), minimum(hi), astype
    int8), each by the next only (a per-tensor quantize with its calibrated scale), c a scalar constant; else None."""
    from edgeq.graph import call_op
    from edgeq.graph_passes import dtype_of

    chain = []
    nxt = only_reader(var)
    if call_op(value_of.get(nxt)) == "relax.reshape":
        chain.append(nxt)
        nxt = only_reader(nxt)
    for op, dtype in (("relax.astype", "float32"), ("relax.divide", None)):
        value = value_of.get(nxt)
        if call_op(value) != op or (dtype is not None and dtype_of(nxt) != dtype) \
                or not value.args[0].same_as(chain[-1] if chain else var):
            return None
        chain.append(nxt)
        nxt = only_reader(nxt)
    divisor = _const_scalar(value_of[chain[-1]].args[1], value_of)
    tail = quantize_tail(chain[-1], value_of, readers)
    if dtype_of(var) != "float16" or tail is None or not divisor:
        return None
    (rounded, low, high), cast, (lo, hi) = tail
    return [*chain, rounded, low, high, cast], (divisor, lo, hi)


def _head_view(var, value_of, only_reader, reader) -> tuple | None:
    """Where ``var`` is a head transpose of one batch, ``permute_dims(t, [0, 2, 1, 3])`` (or ``[0, 2, 3, 1]``, K's
    transposed heads) of t [1, S, H, D], read only by ``reader`` (None: the one it has): (t, (H * D, D), axes, 0, ()),
    the view a batched GEMM reads in its place (``GemmKernel.strides``); else None. Where t is the heads of a slice
    of a wider tensor, ``reshape(strided_slice(T [1, S, F], last axis, [b, b + H x D)))`` (one of the projections
    ``_projections_as_one`` computed as one), read only by the transpose: (T, (F, D), axes, b, (t, the slice)), the
    slice and the reshape read in place too. (For the output's transpose back, the caller takes H and D from the
    transpose's own shape.)"""
    from edgeq.graph import call_op
    from edgeq.graph_passes import dtype_of, shape_of

    value = value_of.get(var)
    if call_op(value) != "relax.permute_dims" or (reader is not None and not _same(only_reader(var), reader)):
        return None
    axes = tuple(int(a) for a in value.attrs.axes) if value.attrs.axes is not None else None
    t = value.args[0]
    shape = shape_of(t)
    if axes not in ((0, 2, 1, 3), (0, 2, 3, 1)) or shape is None or len(shape) != 4 or shape[0] != 1 \
            or dtype_of(t) != "float16" or shape[3] % ALIGNMENT:
        return None
    sliced = value_of.get(t)
    if call_op(sliced) == "relax.reshape" and _same(only_reader(t), var):
        part = sliced.args[0]
        cut = _last_axis_slice(part, value_of)
        whole = shape_of(cut[0]) if cut is not None else None
        if cut is not None and _same(only_reader(part), t) and whole is not None and len(whole) == 3 \
                and list(whole[:2]) == list(shape[:2]) and cut[2] - cut[1] == shape[2] * shape[3] \
                and cut[1] % ALIGNMENT == 0 and whole[2] % ALIGNMENT == 0:
            return cut[0], (whole[2], shape[3]), axes, cut[1], (t, part)
    return t, (shape[2] * shape[3], shape[3]), axes, 0, ()


def _last_axis_slice(var, value_of) -> tuple | None:
    """(T, begin, end) where ``var`` is ``strided_slice(T, [last axis], [begin], [end])`` with step 1 and
    0 <= begin < end <= T's last extent; else None."""
    from edgeq.graph import call_op
    from edgeq.graph_passes import shape_of

    value = value_of.get(var)
    if call_op(value) != "relax.strided_slice":
        return None

    def ints(expr):  # strided_slice's axes, begin, end and strides: tuples of PrimValues
        fields = getattr(expr, "fields", expr)
        return [int(getattr(f, "value", f)) for f in fields]

    t, axes, begin, end = value.args[0], ints(value.args[1]), ints(value.args[2]), ints(value.args[3])
    shape = shape_of(t)
    if shape is None or len(axes) != 1 or axes[0] % len(shape) != len(shape) - 1 or (
            len(value.args) > 4 and any(v != 1 for v in ints(value.args[4]))):
        return None
    first, last = (v + shape[-1] if v < 0 else v for v in (begin[0], end[0]))
    last = min(last, shape[-1])
    return (t, first, last) if 0 <= first < last else None


def _output_shape(out, problem) -> dict:
    """``{"y": shape}`` where the chain's output has another shape than the problem's NPQK (a reshape the chain went
    through: the same elements in the same order), else {}."""
    from edgeq.graph_passes import shape_of

    shape = tuple(int(d) for d in shape_of(out))
    return {} if shape == (problem.n, problem.p, problem.q, problem.k) else {"y": shape}


def _int8_chain(b, value_of, only_reader, follow, readers, params, sm_count: int, smem_per_block: int,
                name: str, taken=frozenset()) -> Claimed | str:
    """The int8 chain from the conv2d bound by ``b`` as one Claimed kernel, or why it is left to dlight. The chain
    (what ``prepare_nhwc`` leaves of edgeq's requantization and of quantize/dequantize):
    ``conv2d(int8 NHWC, int8 OHWI) -> int32 -> + bias (int32 [K]) -> astype float32 -> * scale (per channel or
    scalar) -> [+ shift] -> [x * sigmoid(x) (SiLU)] -> [+ float32(residual int8) * s] -> [relu] -> [/ s] -> round ->
    [max lo] [min hi] -> [astype int32] -> astype int8``."""
    from edgeq.graph import call_op, const_value
    from edgeq.graph_passes import dtype_of, shape_of

    value = b.value
    attrs = value.attrs
    x, w = value.args
    xs, ws = shape_of(x), shape_of(w)
    depthwise = _depthwise(attrs, xs, ws)
    if attrs.data_layout != "NHWC" or (attrs.kernel_layout != "OHWI" or int(attrs.groups) != 1) and not depthwise:
        return f"{attrs.data_layout}/{attrs.kernel_layout}, groups {int(attrs.groups)}"
    if dtype_of(b.var) != "int32" or dtype_of(w) != "int8":
        return "not int8 x int8 -> int32"
    if w not in params:
        return "weights computed at run time"
    pads = [int(v) for v in attrs.padding]
    if pads[0] != pads[2] or pads[1] != pads[3]:
        return "asymmetric padding"
    k, kr, ks = (ws[2], ws[0], ws[1]) if depthwise else (ws[0], ws[1], ws[2]) if ws is not None else (0, 0, 0)
    if xs is None or ws is None or xs[3] % ALIGNMENT or k % ALIGNMENT:  # 64-bit loads where not a multiple of 16
        return "input or output channels not a multiple of 8"

    def op_of(var):
        return call_op(value_of.get(var)) if var is not None else None

    def other(var, prev):
        args = [a for a in value_of[var].args if not a.same_as(prev)]
        return args[0] if len(args) == 1 else None

    def per_channel(expr) -> tuple | None:
        """The shape of a float32 constant or weight of K elements along the last axis (or of one element)."""
        if expr is None or (expr not in params and const_value(expr) is None) or dtype_of(expr) != "float32":
            return None
        shape = tuple(shape_of(expr) or ())
        size = int(np.prod(shape)) if shape else 1
        return shape if size == 1 or (size == k and shape[-1] == k) else None

    chain = [b.var]
    nxt = follow(chain, k)
    bias = None
    if op_of(nxt) == "relax.add":  # a linear layer's bias comes after its scales, in float (no int32 bias here)
        bias = other(nxt, chain[-1])
        if bias is None or bias not in params or dtype_of(bias) != "int32" or shape_of(bias)[-1] != k \
                or int(np.prod(shape_of(bias))) != k:
            return "no int32 per-channel bias after it"
        chain.append(nxt)
        nxt = follow(chain, k)
    if op_of(nxt) != "relax.astype" or str(value_of[nxt].attrs.dtype) != "float32":
        return "no float32 cast after its bias"
    chain.append(nxt)
    mul = follow(chain, k)
    scale = other(mul, chain[-1]) if op_of(mul) == "relax.multiply" else None
    scale_shape = per_channel(scale)
    if scale_shape is None or int(np.prod(scale_shape or (1,))) != k:
        return "no per-channel scale after it"
    chain.append(mul)
    shapes = {"bias": tuple(shape_of(bias)) if bias is not None else (k,), "scale": scale_shape}
    shift = None
    nxt = follow(chain, k)
    if op_of(nxt) == "relax.add":  # + shift (a folded BatchNorm's), a float32 per-channel constant or weight
        candidate = other(nxt, chain[-1])
        shift_shape = per_channel(candidate)
        if shift_shape is not None and int(np.prod(shift_shape or (1,))) == k:
            shift, shapes["shift"] = candidate, shift_shape
            chain.append(nxt)
            nxt = only_reader(nxt)
    problem = Conv2dProblem(xs[0], xs[1], xs[2], xs[3], k, kr, ks, (pads[0], pads[1]),
                            tuple(int(v) for v in attrs.strides), tuple(int(v) for v in attrs.dilation),
                            c_real=xs[3] - _channels_padded(x, value_of), groups=k if depthwise else 1)
    kind = DepthwiseKernel if depthwise else ConvKernel
    tile = None if depthwise else choose_tile(problem, sm_count, smem_per_block, "int8")
    # what follows the scale (and shift) up to the int8 cast; where it is not that, the kernel ends at the scale
    # (or shift) with a float32 output and the operators after it stay as they are
    silu = _silu_of(chain[-1], readers, value_of, only_reader) if nxt is None else None
    if silu is not None:  # SiLU (x * sigmoid(x)) in float, before the rest
        chain = chain + silu
        nxt = only_reader(chain[-1])
    float_chain = list(chain)
    rest = ("its output is another kernel's residual" if nxt is not None and nxt in taken else
            _requantize_tail(chain, nxt, value_of, only_reader, op_of, other, per_channel, taken, not depthwise))
    if depthwise and _output_shape((rest[0] if not isinstance(rest, str) else float_chain)[-1], problem):
        return "a depthwise output seen through a reshape"
    one_by_one = (kr, ks, problem.stride, problem.pad) == (1, 1, (1, 1), (0, 0))
    token = (_token_epilogue(float_chain[-1], k, value_of, only_reader, readers, params, taken, op_of, other,
                             per_channel)
             if isinstance(rest, str) and one_by_one and not depthwise and bias is None and shift is None
             and silu is None else None)
    if token is not None:  # a per-token linear layer: the token scale, bias and what follows in the epilogue
        token, bias, tail, out_dtype, gelu, residual = token
        kernel = TokenLinearKernel(name, problem, tile, "gelu" if gelu else "identity", residual is not None, "int8",
                                   float_out=out_dtype == "float32", out_dtype=out_dtype, gelu=gelu)
        shapes = {"scale": scale_shape, "bias": tuple(shape_of(bias)) if bias is not None else (k,),
                  "token": tuple(shape_of(token)), **_output_shape(tail[-1], problem)}
        return Claimed(kernel, tail[-1], x, w, bias, residual, tuple(float_chain + tail[:-1]), shapes, scale,
                       token=token)
    if isinstance(rest, str):  # float32 out, with the residual and the activation clamps that follow (a ReLU6 or
        # a last residual block before a global pool)
        act_lo, act_hi = -math.inf, math.inf
        nxt = only_reader(float_chain[-1])
        found = None if depthwise else _residual_of(float_chain, nxt, value_of, only_reader, op_of, other, taken, True)
        residual, residual_scale = None, 0.0
        if found is not None and not isinstance(found, str):
            residual, residual_scale, joined = found
            float_chain += joined
            nxt = only_reader(nxt)
        while op_of(nxt) in ("relax.nn.relu", "relax.maximum", "relax.minimum"):
            c = 0.0 if op_of(nxt) == "relax.nn.relu" else _const_scalar(value_of[nxt].args[1])
            if c is None or not value_of[nxt].args[0].same_as(float_chain[-1]):
                break
            act_lo, act_hi = (max(act_lo, c), act_hi) if op_of(nxt) != "relax.minimum" else (act_lo, min(act_hi, c))
            float_chain.append(nxt)
            nxt = only_reader(nxt)
        activation = {(-math.inf, math.inf): "identity", (0.0, math.inf): "relu", (0.0, 6.0): "relu6"}.get(
            (act_lo, act_hi), "clip")
        res_dtype = dtype_of(residual) if residual is not None and dtype_of(residual) != "float32" else ""
        kernel = kind(name, problem, tile, activation, residual is not None, "int8", residual_scale, act_lo=act_lo,
                      act_hi=act_hi, float_out=True, silu=silu is not None, residual_dtype=res_dtype)
        return Claimed(kernel, float_chain[-1], x, w, bias, residual, tuple(float_chain[:-1]),
                       {**shapes, **_output_shape(float_chain[-1], problem)}, scale, shift)
    chain, residual, residual_scale, act_lo, act_hi, out_div, lo, hi, post = rest
    activation = {(-math.inf, math.inf): "identity", (0.0, math.inf): "relu", (0.0, 6.0): "relu6"}.get(
        (act_lo, act_hi), "clip")
    res_dtype = "float32" if residual is not None and dtype_of(residual) == "float32" else ""
    kernel = kind(name, problem, tile, activation, residual is not None, "int8", residual_scale, act_lo, act_hi,
                  out_div, lo, hi, silu=silu is not None, post=post is not None, residual_dtype=res_dtype)
    if post is not None:
        shapes["post"] = per_channel(post)
    return Claimed(kernel, chain[-1], x, w, bias, residual, tuple(chain[:-1]),
                   {**shapes, **_output_shape(chain[-1], problem)}, scale, shift, post)


def _token_epilogue(out, k, value_of, only_reader, readers, params, taken, op_of, other, per_channel):
    """What follows an int8 linear layer's weight scale ``out`` where its input is quantized per token: ``* token
    (a float32 tensor [..., M, 1] computed at run time: each row's scale) -> [+ bias (float32, K)] -> [astype float16
    | GELU (erf form) [astype float16] | + residual (float32, the output's shape)]``, as (token, bias, the vars after ``out``, the
    output's dtype, ``TokenLinearKernel.gelu``, residual); None where ``out`` is not read so."""
    from edgeq.graph import const_value
    from edgeq.graph_passes import dtype_of, shape_of

    mul = only_reader(out)
    token = other(mul, out) if op_of(mul) == "relax.multiply" and mul not in taken else None
    ys, ts = shape_of(out), shape_of(token) if token is not None else None
    if token is None or token in params or const_value(token) is not None or dtype_of(token) != "float32" \
            or ys is None or ts is None or tuple(ts) != (*tuple(ys)[:-1], 1):
        return None
    chain, bias = [mul], None
    nxt = only_reader(mul)
    if op_of(nxt) == "relax.add" and nxt not in taken:
        candidate = other(nxt, mul)
        shape = per_channel(candidate)
        if shape is not None and int(np.prod(shape or (1,))) == k:
            bias = candidate
            chain.append(nxt)
            nxt = only_reader(nxt)
    last = chain[-1]
    if op_of(nxt) == "relax.astype" and dtype_of(nxt) == "float16" and nxt not in taken:
        return token, bias, chain + [nxt], "float16", None, None
    gelu = _gelu_of(last, readers, value_of, only_reader)
    if gelu is not None and not any(v in taken for v in gelu):
        scaled, erf, one_plus, half, final = gelu
        divide = op_of(scaled) == "relax.divide"
        constant = _const_scalar(value_of[scaled].args[1] if divide else other(scaled, last), value_of)
        one = _const_scalar(other(one_plus, erf), value_of)
        half_first = _const_scalar(other(half, last), value_of) is not None  # (x * 0.5) * (1 + erf)
        halved = _const_scalar(other(half, last) if half_first else other(final, half), value_of)
        cast = only_reader(final)  # the next layer's fp16 input (an fp16 layer of the int8 graph: FFN's second)
        tail, out_dtype = ((chain + gelu + [cast], "float16") if op_of(cast) == "relax.astype"
                           and dtype_of(cast) == "float16" and cast not in taken else (chain + gelu, "float32"))
        return token, bias, tail, out_dtype, (constant, divide, halved, one, half_first), None
    if op_of(nxt) == "relax.add" and nxt not in taken:
        r = other(nxt, last)
        if r is not None and dtype_of(r) == "float32" and shape_of(r) == ys and r not in taken \
                and not any(_same(r, v) for v in chain):
            return token, bias, chain + [nxt], "float32", None, r
    return token, bias, chain, "float32", None, None

def _residual_of(chain, nxt, value_of, only_reader, op_of, other, taken, allow_float: bool):
    """Where ``nxt`` is ``add(chain[-1], r)`` (and no other kernel's): (the residual operand, its scale, the vars
    that join the chain). r is a dequantized int8 tensor of the output's shape, ``float32(res) * s`` (res, s), or,
    with ``allow_float``, a float32 tensor of that shape (r, 1.0: another int8 layer's float output, a ResNet's
    downsampling shortcut, which the epilogue adds as it is). None where ``nxt`` is no such add's; a str: why not."""
    from edgeq.graph_passes import dtype_of, shape_of

    if op_of(nxt) != "relax.add" or nxt in taken:
        return None
    r = other(nxt, chain[-1])
    if r is None:
        return "an add of its output with itself"
    r_cast = value_of[r].args[0] if op_of(r) == "relax.multiply" else None
    r_scale = _const_scalar(value_of[r].args[1]) if r_cast is not None else None
    if r_scale is not None and op_of(r_cast) == "relax.astype" and _same(only_reader(r), nxt) \
            and _same(only_reader(r_cast), r):
        res = value_of[r_cast].args[0]
        if dtype_of(res) == "int8" and shape_of(res) == shape_of(chain[-1]):
            return res, r_scale, [r_cast, r, nxt]
    if allow_float and dtype_of(r) == "float32" and shape_of(r) == shape_of(chain[-1]) and r not in taken \
            and not any(_same(r, v) for v in chain):
        return r, 1.0, [nxt]
    return "an add after it of no dequantized int8 residual (one scale) nor float32 tensor of its shape"


def _requantize_tail(chain, nxt, value_of, only_reader, op_of, other, per_channel, taken=frozenset(),
                     allow_float=False):
    """After an int8 convolution's scale: ``[+ float32(residual int8) * s] -> [activation clamps] -> [* post (per
    channel: a depthwise layer's input channel scale)] -> [/ s] -> round -> [max lo] [min hi] -> [astype int32] ->
    astype int8``, as (chain, residual, residual_scale, act_lo, act_hi, out_div, lo, hi, post); or why not."""

    chain = list(chain)
    residual, residual_scale, act_lo, act_hi, out_div = None, 0.0, -math.inf, math.inf, 1.0
    found = _residual_of(chain, nxt, value_of, only_reader, op_of, other, taken, allow_float)
    if isinstance(found, str):
        return found
    if found is not None:
        residual, residual_scale, joined = found
        chain += joined
        nxt = only_reader(nxt)
    while op_of(nxt) in ("relax.nn.relu", "relax.maximum", "relax.minimum"):  # the activation, in float
        c = 0.0 if op_of(nxt) == "relax.nn.relu" else _const_scalar(value_of[nxt].args[1])
        if c is None:
            return "a clamp by no constant"
        act_lo, act_hi = (max(act_lo, c), act_hi) if op_of(nxt) != "relax.minimum" else (act_lo, min(act_hi, c))
        chain.append(nxt)
        nxt = only_reader(nxt)
    post = None
    if op_of(nxt) == "relax.multiply":  # x a per-channel constant of K elements (one element: a scalar is no post)
        candidate = other(nxt, chain[-1])
        shape = per_channel(candidate)
        if shape is None or int(np.prod(shape or (1,))) == 1:
            return "a multiply after its activation by no per-channel constant"
        post = candidate
        chain.append(nxt)
        nxt = only_reader(nxt)
    if op_of(nxt) == "relax.divide":
        d = _const_scalar(value_of[nxt].args[1])
        if d is None or d == 0:
            return "a division after it by no constant"
        out_div = d
        chain.append(nxt)
        nxt = only_reader(nxt)
    if op_of(nxt) != "relax.round":
        return "no rounding to int8 after it (its output is float)"
    chain.append(nxt)
    nxt = only_reader(nxt)
    lo, hi = -128.0, 127.0
    while op_of(nxt) in ("relax.maximum", "relax.minimum"):
        c = _const_scalar(value_of[nxt].args[1])
        if c is None:
            return "a clamp by no constant"
        lo, hi = (max(lo, c), hi) if op_of(nxt) == "relax.maximum" else (lo, min(hi, c))
        chain.append(nxt)
        nxt = only_reader(nxt)
    if op_of(nxt) == "relax.astype" and str(value_of[nxt].attrs.dtype) == "int32":
        chain.append(nxt)
        nxt = only_reader(nxt)
    if op_of(nxt) != "relax.astype" or str(value_of[nxt].attrs.dtype) != "int8":
        return "no int8 cast at the end"
    chain.append(nxt)
    return chain, residual, residual_scale, act_lo, act_hi, out_div, lo, hi, post


def _same(a, b) -> bool:
    return a is not None and b is not None and a.same_as(b)


def _channels_padded(x, value_of) -> int:
    """The zero channels ``prepare_nhwc`` added to a convolution's input (a pad on the last axis, maybe behind
    ToMixedPrecision's cast), so that FLOPs count the model's channels only."""
    from edgeq.graph import call_op

    value = value_of.get(x)
    if call_op(value) == "relax.astype":
        value = value_of.get(value.args[0])
    if call_op(value) != "relax.nn.pad":
        return 0
    widths = [int(v) for v in value.attrs.pad_width]
    return widths[-1] if not any(widths[:-1]) else 0


def _ty(var):
    return getattr(var, "struct_info", None) or var.ty


def _free_vars(expr):
    from edgeq.tvm_env import relax

    return relax.analysis.free_vars(expr)


def claim_convs(mod, claimed: Sequence[Claimed], sizes: dict[str, int], placements: Sequence = (), heads: Sequence = ()):
    """``mod`` with each claimed chain replaced by one ``call_tir`` of its kernel's PrimFunc (added to the module):
    the chain's last binding becomes the call, its other bindings go. ``placements``
    (``concat_in_place.find_placements``, the claims ``concat_in_place.place``'s): a placed part's call binds the
    concatenation (the first part's allocates it, a later part's writes it in place) and the part's variable becomes
    a slice of it; the concatenation's binding becomes the tensor after its last part. ``heads``
    (``concat_in_place.find_head_outputs``): each part's call binds the detector's output after its write, the
    bindings between go, and the output's becomes the last version."""
    from edgeq.tvm_env import relax

    functions = {c.kernel.function: prim_func(c.kernel, sizes[c.kernel.name], c.shapes) for c in claimed}
    functions.update({pl.pools.function: pl.pool_prim_func() for pl in placements if pl.pools})
    dropped = {var for c in claimed for var in c.chain} | {v for pl in placements if pl.pools for v in pl.pools.pooled}
    dropped |= {var for pl in placements for var in pl.ups}  # an upsampling its convolution writes
    dropped |= {var for h in heads for var in h.dropped}
    head_part = {var: (h, i) for h in heads for i, (var, _, _) in enumerate(h.parts)}
    head_out = {h.out: h for h in heads}
    by_output = {c.output: c for c in claimed}
    version = {var: (pl, i) for pl in placements for i, (var, _) in enumerate(pl.parts)}
    up_version = {src: version[var] for pl in placements for var, src in pl.ups.items()}
    concats = {pl.concat: pl for pl in placements}

    def rebind(b, gvars):
        if b.var in head_out:  # the detector's output: as its last part's kernel left it
            return [relax.VarBinding(b.var, head_out[b.var].versions[-1])]
        if b.var in dropped:
            return []
        if b.var in concats:  # the tensor after its last part (SPPF: after its pool kernel, in place)
            pl = concats[b.var]
            if pl.pools is None:
                return [relax.VarBinding(b.var, pl.versions[-1])]
            return [relax.VarBinding(b.var, relax.call_tir_inplace(
                gvars[pl.pools.function], relax.Tuple([pl.versions[-1]]), [0], _ty(b.var)))]
        c = by_output.get(b.var)
        if c is None:
            return [b]
        gv, operands = gvars[c.kernel.function], relax.Tuple(list(c.operands()))
        if b.var in head_part:  # its part of the detector's output (the first part's call allocates it)
            h, i = head_part[b.var]
            ty = _ty(h.out)
            call = (relax.call_tir_inplace(gv, relax.Tuple([*operands.fields, c.y_in]), [len(operands.fields)], ty)
                    if i else relax.call_tir(gv, operands, ty))
            return [relax.VarBinding(h.versions[i], call)]
        if b.var not in version and b.var not in up_version:
            return [relax.VarBinding(b.var, relax.call_tir(gv, operands, _ty(b.var)))]
        pl, i = version.get(b.var, (None, None))
        ty, tensor = (_ty(pl.concat), pl.versions[i]) if pl is not None else (_ty(b.var), b.var)
        placed = []
        if pl is not None:
            first = c.kernel.out_view[0]
            placed = [relax.VarBinding(b.var, relax.op.strided_slice(
                tensor, axes=[3], begin=[first], end=[first + c.kernel.problem.k]))]
        if b.var in up_version:  # two outputs: y (maybe in place) and the upsampled copy's tensor (in place)
            up_pl, j = up_version[b.var]
            fields = [*operands.fields, c.up_in] + ([c.y_in] if c.kernel.out_in_place else [])
            n = len(fields)
            indices = [n - 1, n - 2] if c.kernel.out_in_place else [-1, n - 1]
            both_ty = relax.TupleType([ty, _ty(up_pl.concat)])
            both = relax.DataflowVar(f"{b.var.name}_and_upsampled", both_ty)
            call = relax.call_tir_inplace(gv, relax.Tuple(fields), indices, [ty, _ty(up_pl.concat)])
            return [relax.VarBinding(both, call), relax.VarBinding(tensor, relax.TupleGetItem(both, 0)),
                    relax.VarBinding(up_pl.versions[j], relax.TupleGetItem(both, 1)), *placed]
        if c.kernel.out_in_place:
            operands = relax.Tuple([*operands.fields, c.y_in])
            call = relax.call_tir_inplace(gv, operands, [len(operands.fields) - 1], ty)
        else:
            call = relax.call_tir(gv, operands, ty)
        return [relax.VarBinding(tensor, call), *placed]

    return rebuild_main(mod, functions, rebind)


def claim_calls(mod, functions: dict, calls: dict, dropped: set):
    """``mod`` with ``functions`` ({name: PrimFunc}) added, each variable of ``calls`` ({var: (function name, Relax
    operands)}) bound to a ``call_tir`` of its function instead, and the bindings of ``dropped`` gone."""
    from edgeq.tvm_env import relax

    def rebind(b, gvars):
        if b.var in dropped:
            return []
        if b.var not in calls:
            return [b]
        name, operands = calls[b.var]
        return [relax.VarBinding(b.var, relax.call_tir(gvars[name], relax.Tuple(list(operands)), _ty(b.var)))]

    return rebuild_main(mod, functions, rebind)


def rebuild_main(mod, functions: dict, rebind):
    """``mod`` with ``functions`` ({name: PrimFunc}) added and each binding of main replaced by the bindings
    ``rebind(binding, {name: GlobalVar})`` returns (none: the binding goes)."""
    from edgeq.tvm_env import relax, tvm

    main = mod["main"]
    bb = relax.BlockBuilder(mod)
    gvars = {name: bb.add_func(func, name) for name, func in functions.items()}
    blocks = [type(block)([new for b in block.bindings for new in rebind(b, gvars)]) for block in main.body.blocks]
    out = tvm.IRModule(dict(bb.get().functions))
    out["main"] = relax.Function(main.params, relax.SeqExpr(blocks, main.body.body), main.ret_ty, main.is_pure,
                                 main.attrs)
    return out


def twin_prim_func(kernel: ConvKernel, shapes: dict | None = None):
    """A plain TIR function (TE, no CUTLASS) with the signature and the arithmetic of ``kernel``'s PrimFunc:
    the independent host implementation a rewritten graph is run with on the build host (``with_twins``)."""
    from edgeq.tvm_env import tvm

    te, tirx = tvm.te, tvm.tirx
    p = kernel.problem
    if isinstance(kernel, GemmKernel):  # the product over (batch, M, N), each operand read at its flat offset
        (_, a_shape, _), (_, w_shape, _), (_, y_shape, _) = kernel_operands(kernel, shapes)
        a, w = te.placeholder(a_shape, "float16", "a"), te.placeholder(w_shape, "float16", "w")
        st = kernel.strides

        def at(tensor, offset):  # element ``offset`` of a row-major tensor
            index = []
            for d in reversed(tensor.shape):
                index.append(offset % d)
                offset = offset // d
            return tensor[tuple(reversed(index))]

        rk = te.reduce_axis((0, p.k), "rk")
        (lda, bsa), (ldb, bsb) = st["a"], st["w"]
        acc = te.compute((p.batch, p.m, p.n), lambda z, i, j: te.sum(
            at(a, kernel.a_offset + z * bsa + i * lda + rk).astype("float32")
            * at(w, kernel.b_offset + z * bsb + (j * ldb + rk if kernel.b_column_major else rk * ldb + j)).astype("float32"),
            axis=rk), "acc")
        alpha = tirx.const(float(np.float32(kernel.alpha)), "float32")
        (ldc, bsc) = st["y"]

        def out(*index):  # the (batch, row, column) the kernel writes at this element of y
            flat = 0
            for i, d in zip(index, y_shape):
                flat = flat * d + i
            v = acc[(flat // bsc) % p.batch, (flat // ldc) % p.m, flat % p.n] * alpha
            if kernel.quantize:
                divisor, lo, hi = (tirx.const(float(np.float32(c)), "float32") for c in kernel.quantize)
                v = tirx.round(v.astype("float16").astype("float32") / divisor)
                return tirx.min(tirx.max(v, lo), hi).astype("int8")
            return v if kernel.float_out else v.astype("float16")

        return te.create_prim_func([a, w, te.compute(y_shape, out, "y")])
    args, y = twin_tensors(kernel, shapes)
    outs = list(y) if isinstance(y, tuple) else [y]  # (the upsampled copy's tensor, y)
    func = te.create_prim_func(args + outs)
    params = list(func.params)  # [..., y_up as it came in, y as it came in, y_up, y]: each written in place
    inplace = {}
    if getattr(kernel, "out_in_place", False):  # y is the tensor that came in (``call_tir_inplace``)
        inplace[params[-1]] = params[-1 - len(outs)]
    if len(outs) == 2:
        inplace[params[-2]] = params[-3 - int(bool(kernel.out_in_place))]
    return func.specialize(inplace) if inplace else func


def twin_tensors(kernel: ConvKernel, shapes: dict | None = None, x=None) -> tuple[list, object]:
    """The TE of a convolution's ``twin_prim_func``: (its operands but y, in ``kernel_operands`` order, y). ``x``: a
    TE tensor computed in front of the kernel (``pool_classifier``'s pooled features) in the operand's place, which
    then is not among the operands."""
    from edgeq.tvm_env import tvm

    te, tirx = tvm.te, tvm.tirx
    p = kernel.problem
    (ph, pw), (sh, sw), (dh, dw) = p.pad, p.stride, p.dilation
    int8 = kernel.precision == "int8"
    operands = {name: (shape, dtype) for name, shape, dtype in kernel_operands(kernel, shapes)}
    ph_ = {name: te.placeholder(shape, dtype, name) for name, (shape, dtype) in operands.items()
           if name != "y" and (name != "x" or x is None)}
    given = x is not None
    if given:
        ph_["x"] = x
    x, w, res = ph_["x"], ph_["w"], ph_.get("residual")
    acc_dtype = "int32" if int8 else "float32"
    zero = tirx.const(0, x.dtype)
    c0 = kernel.x_view[0] if kernel.x_view else 0  # the channel slice x is read from
    xp = te.compute((p.n, p.h + 2 * ph, p.w + 2 * pw, p.c), lambda i, y, z, c: tirx.if_then_else(
        tirx.all(y >= ph, y < p.h + ph, z >= pw, z < p.w + pw), x[i, y - ph, z - pw, c + c0], zero), "xp")
    ry, rx = te.reduce_axis((0, p.r), "ry"), te.reduce_axis((0, p.s), "rx")
    if p.depthwise:  # weights HWOI
        acc = te.compute((p.n, p.p, p.q, p.k), lambda i, y, z, o: te.sum(
            xp[i, y * sh + ry * dh, z * sw + rx * dw, o].astype(acc_dtype) * w[ry, rx, o, 0].astype(acc_dtype),
            axis=[ry, rx]), "acc")
    elif p.groups > 1:  # grouped: output channel o reads its group's channels
        kg, cg = p.k // p.groups, p.c // p.groups
        rc = te.reduce_axis((0, cg), "rc")
        acc = te.compute((p.n, p.p, p.q, p.k), lambda i, y, z, o: te.sum(
            xp[i, y * sh + ry * dh, z * sw + rx * dw, o // kg * cg + rc].astype(acc_dtype)
            * w[o, ry, rx, rc].astype(acc_dtype), axis=[ry, rx, rc]), "acc")
    else:
        rc = te.reduce_axis((0, p.c), "rc")
        acc = te.compute((p.n, p.p, p.q, p.k), lambda i, y, z, o: te.sum(
            xp[i, y * sh + ry * dh, z * sw + rx * dw, rc].astype(acc_dtype) * w[o, ry, rx, rc].astype(acc_dtype),
            axis=[ry, rx, rc]), "acc")
    slices = kernel.tile.split_k if kernel.tile is not None else 1

    def part(j):  # serial split-K: slice j sums the channel tiles t with t % slices == j
        ry_, rx_, rc_ = (te.reduce_axis((0, d), f"{a}{j}") for a, d in (("ry", p.r), ("rx", p.s), ("rc", p.c)))
        return te.compute((p.n, p.p, p.q, p.k), lambda i, y, z, o: te.sum(tirx.if_then_else(
            rc_ // kernel.tile.block[2] % slices == j,
            xp[i, y * sh + ry_ * dh, z * sw + rx_ * dw, rc_].astype(acc_dtype) * w[o, ry_, rx_, rc_].astype(acc_dtype),
            tirx.const(0, acc_dtype)), axis=[ry_, rx_, rc_]), f"acc{j}")

    parts = [part(j) for j in range(slices)] if slices > 1 else []

    def at(name, o):  # a per-channel operand, [K] or [1, 1, 1, K]
        t = ph_[name]
        return t[(0,) * (len(t.shape) - 1) + (o,)]

    npqk = (p.n, p.p, p.q, p.k)
    y_shape = tuple(operands["y"][0])

    def reindex(index, shape_from, shape_to):  # the same element of a tensor viewed in another shape
        if tuple(shape_from) == tuple(shape_to):
            return tuple(index)
        flat = 0
        for i, d in zip(index, shape_from):
            flat = flat * d + i
        out = []
        for d in reversed(shape_to):
            out.append(flat % d)
            flat = flat // d
        return tuple(reversed(out))

    def f32(v):
        return tirx.const(v, "float32")

    def residual(i, y, z, o):  # the residual's element of output (i, y, z, o)
        if kernel.residual_view:
            return res[i, y, z, o + kernel.residual_view[0]]
        return res[reindex((i, y, z, o), npqk, npqk if kernel.out_view else y_shape)]

    def epilogue_int8(i, y, z, o):
        v = (acc[i, y, z, o] + at("bias", o)).astype("float32") * at("scale", o) + at("shift", o)
        if kernel.silu:  # through edgeq's exp, as the device's epilogue (device_math.py)
            v = silu_rn_tir(v)
        if res is not None:
            v = v + residual(i, y, z, o).astype("float32") * f32(kernel.residual_scale)
        if not math.isinf(kernel.act_lo):
            v = te.max(v, f32(kernel.act_lo))
        if not math.isinf(kernel.act_hi):
            v = te.min(v, f32(kernel.act_hi))
        if kernel.post:
            v = v * at("post", o)
        if kernel.float_out:
            return v
        v = tirx.round(v / f32(kernel.out_div))
        return te.min(te.max(v, f32(kernel.lo)), f32(kernel.hi)).astype("int8")

    def epilogue_token(i, y, z, o):  # ``TokenLinearKernel``: the graph's operators, in its order
        token = ph_["token"]
        v = acc[i, y, z, o].astype("float32") * at("scale", o) * token[reindex((i, y, z), npqk[:3], operands["token"][0])] \
            + at("bias", o)
        if kernel.gelu is not None:
            constant, divide, half, one, half_first = kernel.gelu
            t = tirx.erf(v / f32(constant) if divide else v * f32(constant)) + f32(one)
            v = v * f32(half) * t if half_first else v * t * f32(half)
        if res is not None:
            v = v + residual(i, y, z, o)
        return v.astype(kernel.out_dtype)

    def epilogue_fp16(i, y, z, o):
        v = acc[i, y, z, o] if not parts else parts[0][i, y, z, o]
        if res is not None and not kernel.residual_after:
            v = v + residual(i, y, z, o).astype("float32")
        for part in parts[1:]:  # each slice adds the partial sum the one before left in the output, in its type
            v = part[i, y, z, o] + v.astype("float32" if kernel.float_out else "float16").astype("float32")
        v = v + at("bias", o).astype("float32")
        if kernel.activation == "relu":
            v = te.max(v, f32(0.0))
        elif kernel.activation == "relu6":
            v = te.min(te.max(v, f32(0.0)), f32(6.0))
        elif kernel.activation == "silu":
            v = v * te.sigmoid(v)
        elif kernel.activation == "gelu":
            v = f32(0.5) * v * (f32(1.0) + tirx.erf(v * f32(1 / math.sqrt(2))))
        elif kernel.activation == "hardswish":  # CUTLASS's HardSwish<float>: x * relu6(x + 3) / 6
            v = v * te.min(te.max(v + f32(3.0), f32(0.0)), f32(6.0)) / f32(6.0)
        elif kernel.activation != "identity":
            raise ValueError(f"no host twin for activation {kernel.activation}")
        if res is not None and kernel.residual_after:
            v = v + residual(i, y, z, o).astype("float32")
        return v if kernel.float_out else v.astype("float16")

    epilogue = epilogue_token if isinstance(kernel, TokenLinearKernel) else epilogue_int8 if int8 else epilogue_fp16
    y = te.compute(npqk, epilogue, "y")
    args = [ph_[name] for name in operands if name not in ("y", "y_up") and not (given and name == "x")]
    up = None
    if getattr(kernel, "up_view", None):  # the output nearest-upsampled 2x into channels [first, first + K) of the
        # tensor that came in; its other channels as they came
        first, y4 = kernel.up_view[0], y
        old_up = te.placeholder(tuple(operands["y_up"][0]), y4.dtype, "y_up_in")
        args.append(old_up)
        up = te.compute(old_up.shape, lambda i, a, b, c: tirx.if_then_else(
            tirx.all(c >= first, c < first + p.k), y4[i, a // 2, b // 2, tirx.max(c - first, 0)], old_up[i, a, b, c]),
            "y_up")
    head = getattr(kernel, "head_out", None)
    if head:  # the detector's output: channels [first, first + K) at anchors [anchor, anchor + P Q), in its dtype;
        # the rest as it came in (or zeros)
        first, anchor, _, _, dtype = head
        y4 = y
        old = te.placeholder(y_shape, dtype, "y_in") if kernel.out_in_place else None
        if old is not None:
            args.append(old)
        y = te.compute(y_shape, lambda i, c, a: tirx.if_then_else(
            tirx.all(c >= first, c < first + p.k, a >= anchor, a < anchor + p.p * p.q),
            y4[i, tirx.max(a - anchor, 0) // p.q, tirx.max(a - anchor, 0) % p.q, tirx.max(c - first, 0)].astype(dtype),
            old[i, c, a] if old is not None else tirx.const(0, dtype)), "y_head")
    elif kernel.out_view:  # channels [first, first + K) of the tensor; the others as they came in (or zeros)
        first, y4 = kernel.out_view[0], y
        old = te.placeholder(y_shape, y4.dtype, "y_in") if kernel.out_in_place else None
        if old is not None:
            args.append(old)
        y = te.compute(y_shape, lambda i, a, b, c: tirx.if_then_else(
            tirx.all(c >= first, c < first + p.k), y4[i, a, b, tirx.max(c - first, 0)],
            old[i, a, b, c] if old is not None else tirx.const(0, y4.dtype)), "y_placed")
    elif y_shape != npqk:  # the chain went through a reshape (a view): the output in the graph's shape
        y4 = y
        y = te.compute(y_shape, lambda *index: y4[reindex(index, y_shape, npqk)], "y_view")
    return args, (y if up is None else (up, y))


def with_twins(mod, claimed: Sequence[Claimed]):
    """A rewritten module (``claim_convs``) with each CUTLASS PrimFunc swapped for its ``twin_prim_func``: it runs
    on the build host, so the rewrite (which operands went where, the fused epilogue) is checked there."""
    from edgeq.tvm_env import tvm

    functions = dict(mod.functions)
    for gv in list(functions):
        for c in claimed:
            if gv.name_hint == c.kernel.function:
                # opaque to fusion, as the CUTLASS call it stands for
                functions[gv] = twin_prim_func(c.kernel, c.shapes).with_attrs(
                    {"global_symbol": gv.name_hint, "op_pattern": 8})
    return tvm.IRModule(functions)
