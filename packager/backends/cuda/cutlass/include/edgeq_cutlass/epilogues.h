// edgeq's CUTLASS epilogue functors (emit.py puts them in every CUDA module with CUTLASS kernels; NVRTC finds this
// folder with -I). Needs CUTLASS's headers and edgeq_cutlass::exp_rn / silu_rn (device_math.py's EXP_RN_CPP) first.
#pragma once
namespace edgeq_cutlass {
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
}  // namespace edgeq_cutlass
