// edgeq's store-only output iterators for CUTLASS's convolution epilogue: a second output (T) written upsampled
// 2x or channel-major into a detector's output, and the kernel type that uses them (WithT). Needs CUTLASS's
// headers first (emit.py's preamble).
#pragma once
namespace edgeq_cutlass {
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
