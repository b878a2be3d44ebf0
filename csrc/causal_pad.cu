// The padded input of Wan's and Qwen-Image's causal 3D convolutions (diffusers' WanCausalConv3d,
// QwenImageCausalConv3d), written in one pass: the values only move, so the convolution gets the same tensor.
//
// Eager builds it as torch.cat([cache_x, x], dim=2) then F.pad(..., (pw0, pw1, ph0, ph1, pt0, 0)): a zero-filled
// tensor and strided copies that aten's elementwise kernel does not vectorise (the Wan 2.1 decode at 832x480x81:
// 195 ms in 2211 such copies on an H100, after ops/causal_conv_pad.py had already cut the concatenation). Here each
// thread writes elements of the contiguous output [B, C, Tp, Hp, Wp] in order, reading the one source element each
// stands for, or writing zero:
//   out[b, c, t, h, w] = cache[b, c, t - pt0, h - ph0, w - pw0]          pt0 <= t < pt0 + ct (inside in h and w)
//                        x[b, c, t - pt0 - ct, h - ph0, w - pw0]         pt0 + ct <= t < pt0 + ct + T (likewise)
//                        0                                               elsewhere (the border)
// A block takes kThreads columns of an output row (b, c, t, h), the rows in turn with a grid stride.
//
// channels_last: the same values written as [B, Tp, Hp, Wp, C] memory (channels_last_3d), so that cuDNN, which runs
// its engines on channels-last tensors, reads the buffer as it is instead of transposing it first (its nchwToNhwc
// pass). The copy transposes: each block moves a kTile x kTile tile of (c, w) of one output row (b, t, h) through
// shared memory, reading along w (the source's unit stride) and writing along c (the output's).
//
// Two other borders, for LTX-Video's and LTX-2's causal convolutions (diffusers' LTXVideoCausalConv3d,
// LTX2VideoCausalConv3d; ops/ltx_causal_conv.py), each a flag of the arguments:
//   replicate_t  the frames before the first are the first frame and those after the last the last frame (eager's
//                x[:, :, :1].repeat(...) and x[:, :, -1:].repeat(...) concatenated around x): the source frame is
//                st clamped to [0, cache_frames + frames - 1];
//   reflect_hw   the rows and columns of the border are F.pad(mode="reflect")'s (reflection_pad3d): the source of
//                position i of an axis of n is -i for i < 0 and 2 (n - 1) - i for i >= n (each padding below n,
//                which eager's F.pad requires and bindings.cpp checks), so no element of the border is a zero.
// Still each output element is one source element, copied as its bits: the values only move. The kernels read these
// flags only in their kModes instantiation; the zero-border one (kModes false: Wan's and Qwen-Image's) is the code it
// was before the flags came.
//
// ltx_rmsnorm_pad_cl_kernel and channel_rmsnorm_pad_cl_kernel: the channels-last copy with LTX-Video's VAE norm and
// SiLU (ops/ltx_vae_rmsnorm_conv.py), or Wan's and Qwen-Image's (ops/channel_rmsnorm_silu.py), applied to each value as
// it is read (below): the norm's output written straight into the causal convolution's input.
#include "elementwise.cuh"
#include "fastpath.h"

namespace diffusers_fastpath {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxRowBlocks = 65535;  // grid.y: min(rows, kMaxRowBlocks); grid.x: ceil(Wp / kThreads)
constexpr int kTile = 32;             // channels-last: a tile of 32 channels x 32 columns, 32 x 8 threads
constexpr int kTileRows = 8;

// F.pad(mode="reflect")'s source of position i of an axis of n positions (the padding below n)
__device__ __forceinline__ int64_t reflect_index(int64_t i, int64_t n) {
  return i < 0 ? -i : (i >= n ? 2 * (n - 1) - i : i);
}

// the repeated first and last frames: the source frame of output frame st (counted from the first source frame) of n
__device__ __forceinline__ int64_t clamp_frame(int64_t st, int64_t n) { return st < 0 ? 0 : (st >= n ? n - 1 : st); }

template <typename T, bool kModes>
__global__ void __launch_bounds__(kThreads) causal_pad_kernel(const CausalPadArgs a) {
  const int64_t w = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t out_w = a.width + a.pad_w0 + a.pad_w1;
  if (w >= out_w) return;
  const int64_t out_h = a.height + a.pad_h0 + a.pad_h1;
  const int64_t out_t = a.pad_t0 + a.cache_frames + a.frames + a.pad_t1;
  const int64_t rows = a.batch * a.channels * out_t * out_h;
  const T* x = static_cast<const T*>(a.x);
  const T* cache = static_cast<const T*>(a.cache);
  T* out = static_cast<T*>(a.out);
  int64_t sw = w - a.pad_w0;
  bool inside_w = sw >= 0 && sw < a.width;
  if constexpr (kModes) {
    if (a.reflect_hw) {
      sw = reflect_index(sw, a.width);
      inside_w = true;
    }
  }
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    int64_t rest = r;
    const int64_t h = rest % out_h;
    rest /= out_h;
    const int64_t t = rest % out_t;
    rest /= out_t;
    const int64_t c = rest % a.channels;
    const int64_t b = rest / a.channels;
    int64_t sh = h - a.pad_h0;
    int64_t st = t - a.pad_t0;
    if constexpr (kModes) {
      if (a.reflect_hw) sh = reflect_index(sh, a.height);
      if (a.replicate_t) st = clamp_frame(st, a.cache_frames + a.frames);
    }
    T v = Storage<T>::store(0.0f);
    if (inside_w && sh >= 0 && sh < a.height && st >= 0) {
      if (st < a.cache_frames) {
        v = cache[b * a.cache_stride_b + c * a.cache_stride_c + st * a.cache_stride_t + sh * a.cache_stride_h + sw];
      } else if (st < a.cache_frames + a.frames) {
        v = x[b * a.x_stride_b + c * a.x_stride_c + (st - a.cache_frames) * a.x_stride_t + sh * a.x_stride_h + sw];
      }
    }
    out[r * out_w + w] = v;
  }
}

// What the channels-last copies write for each source value (V, the tile functions' policy): the value as its bits
// (CopyValues: causal_pad_cl), LTX-Video's VAE norm and SiLU of it (LtxNormValues: ltx_rmsnorm_pad_cl), Wan's and
// Qwen-Image's channel norm and SiLU of it (ChannelNormValues: channel_rmsnorm_pad_cl). A norm reads one fp32 operand
// per source position of x (`per_position`, contiguous [batch, frames * height * width]: the reciprocal eager
// multiplies by, the denominator eager divides by) and ChannelNormValues its channel's gamma and bias (`channel`); no
// cache with a norm (a.cache_frames 0). value(v, p, ch) is the value stored for v, its position's operand p and its
// channel's ch: each the same device function on the same operands as the norm's own kernel, so the same bits.
// kLeavesFront: the frames before x's (a.pad_t0 of them) are left unwritten inside the border, the convolution's to
// fill (its cache's frames and the zeros before them: ops/causal_conv_pad.py's fill_front, which every reader of such
// a buffer runs first); only their border is written here (ChannelNormValues: Wan's decode wrote those frames twice,
// zeros here and the cache there, a fifth of this kernel's bytes at four frames, half at one).
struct CopyValues {
  static constexpr bool kNorm = false;
  static constexpr bool kLeavesFront = false;
  const float* per_position = nullptr;
  struct Channel {};
  template <typename T>
  __device__ __forceinline__ Channel channel(int64_t) const { return {}; }
  template <typename T>
  __device__ __forceinline__ T value(T v, float, Channel) const { return v; }
};

struct LtxNormValues {
  static constexpr bool kNorm = true;
  static constexpr bool kLeavesFront = false;
  const float* per_position;  // the reciprocal: aten's torch.rsqrt(mean + eps)
  struct Channel {};
  template <typename T>
  __device__ __forceinline__ Channel channel(int64_t) const { return {}; }
  template <typename T>
  __device__ __forceinline__ T value(T v, float r, Channel) const { return ltx_rmsnorm_value<T>(v, r, true); }
};

struct ChannelNormValues {
  static constexpr bool kNorm = true;
  static constexpr bool kLeavesFront = true;
  const float* per_position;  // the denominator: aten's norm(2, 1).clamp_min(eps) of x's upcast
  const void* gamma;          // [channels] of T
  const void* bias;           // [channels] of T, or null: `bias_value`
  float scale;
  float bias_value;
  struct Channel {
    float gamma = 0.0f, bias = 0.0f;
  };
  template <typename T>
  __device__ __forceinline__ Channel channel(int64_t c) const {
    return {Storage<T>::load(static_cast<const T*>(gamma)[c]),
            bias != nullptr ? Storage<T>::load(static_cast<const T*>(bias)[c]) : bias_value};
  }
  template <typename T>
  __device__ __forceinline__ T value(T v, float d, Channel ch) const {
    return Storage<T>::store(channel_rmsnorm_value<T>(Storage<T>::load(v), d, ch.gamma, ch.bias, scale, true));
  }
};

// The source of output row r = (b, t, h) of the channels-last buffer (the tiled kernels' rows): the plane (b, st) of
// the cache or of x at row sh it copies, or none (src null: a border row of zeros), its channel stride, and st and sh
// (the frame counted from the first cache frame, the row; with kModes the clamped frame and the reflected row).
template <typename E, bool kModes>
struct SourceRow {
  const E* src = nullptr;
  int64_t stride_c = 0;
  int64_t b, st, sh;
  // a row of the frames before the first source frame, inside the border in height (the zero border: never with
  // kModes); its columns inside the border are what a kLeavesFront policy leaves
  __device__ __forceinline__ bool front(const CausalPadArgs& a) const {
    return !kModes && st < 0 && sh >= 0 && sh < a.height;
  }
  __device__ __forceinline__ SourceRow(const CausalPadArgs& a, int64_t r, int64_t out_h, int64_t out_t) {
    int64_t h, t;
    if (r <= 0x7fffffff && out_h <= 0x7fffffff && out_t <= 0x7fffffff) {
      // (every decode's rows: 32-bit unsigned divisions, the same quotients in a fraction of a 64-bit one's
      // instructions, which a block paid per row of its tile)
      const unsigned q = static_cast<unsigned>(r) / static_cast<unsigned>(out_h);
      h = static_cast<int64_t>(static_cast<unsigned>(r) - q * static_cast<unsigned>(out_h));
      t = static_cast<int64_t>(q % static_cast<unsigned>(out_t));
      b = static_cast<int64_t>(q / static_cast<unsigned>(out_t));
    } else {
      h = r % out_h;
      t = (r / out_h) % out_t;
      b = r / (out_h * out_t);
    }
    sh = h - a.pad_h0;
    st = t - a.pad_t0;
    if constexpr (kModes) {
      if (a.reflect_hw) sh = reflect_index(sh, a.height);
      if (a.replicate_t) st = clamp_frame(st, a.cache_frames + a.frames);
    }
    if (sh >= 0 && sh < a.height && st >= 0) {
      if (st < a.cache_frames) {
        src = static_cast<const E*>(a.cache) + b * a.cache_stride_b + st * a.cache_stride_t + sh * a.cache_stride_h;
        stride_c = a.cache_stride_c;
      } else if (st < a.cache_frames + a.frames) {
        src = static_cast<const E*>(a.x) + b * a.x_stride_b + (st - a.cache_frames) * a.x_stride_t + sh * a.x_stride_h;
        stride_c = a.x_stride_c;
      }
    }
  }
};

// channels_last: grid (ceil(Wp / kTile), min(ceil(C / kTile), kMaxRowBlocks), min(B * Tp * Hp, kMaxRowBlocks)), block
// (kTile, kTileRows); the channel tiles in turn over grid.y and the output rows (b, t, h) over grid.z, each with a grid
// stride (grid.y and grid.z are at most 65535: more than 2M channels take several tiles per block). The body of
// causal_pad_cl_kernel (CopyValues: the values copied as their bits) and of the norms' kernels below (each value of x
// the norm's result for it, `values`); `base` is the tile's shared address.
template <typename T, bool kModes, typename V>
__device__ __forceinline__ void pad_cl_tiles(const CausalPadArgs& a, unsigned base, const V& values) {
  using W = typename Word<sizeof(T)>::type;  // the values are copied as their bits
  const int64_t out_w = a.width + a.pad_w0 + a.pad_w1;
  const int64_t out_h = a.height + a.pad_h0 + a.pad_h1;
  const int64_t out_t = a.pad_t0 + a.cache_frames + a.frames + a.pad_t1;
  const int64_t rows = a.batch * out_t * out_h;
  const int64_t w0 = static_cast<int64_t>(blockIdx.x) * kTile;
  W* out = static_cast<W*>(a.out);
  const int64_t w_read = w0 + threadIdx.x;  // the column this thread reads (along the source's unit stride)
  int64_t sw = w_read - a.pad_w0;
  bool inside_w = w_read < out_w && sw >= 0 && sw < a.width;
  if constexpr (kModes) {
    if (a.reflect_hw) {
      sw = reflect_index(sw, a.width);
      inside_w = w_read < out_w;
    }
  }
  for (int64_t c0 = static_cast<int64_t>(blockIdx.y) * kTile; c0 < a.channels;
       c0 += static_cast<int64_t>(gridDim.y) * kTile) {  // (bounds uniform over the block: __syncthreads is safe)
    const int64_t c_write = c0 + threadIdx.x;  // the channel this thread writes (along the output's unit stride)
    for (int64_t r = blockIdx.z; r < rows; r += gridDim.z) {
      const SourceRow<W, kModes> row(a, r, out_h, out_t);
      const W* src = row.src;  // the source plane (b, st) at row sh, or none (the border)
      const int64_t stride_c = row.stride_c, b = row.b, st = row.st, sh = row.sh;
      const bool leave = V::kLeavesFront && row.front(a);  // the columns inside the border are left
      if (leave && w0 >= a.pad_w0 && w0 + kTile <= a.pad_w0 + a.width) continue;  // (the whole tile: uniform)
      float rs = 0.0f;  // a norm's operand of the source position (b, st, sh, sw), one per column
      if constexpr (V::kNorm) {
        if (src != nullptr && inside_w) {
          rs = __ldg(values.per_position + ((b * a.frames + st - a.cache_frames) * a.height + sh) * a.width + sw);
        }
      }
      transpose_tile<W, kTile, kTileRows>(
          base,
          [&](unsigned i) -> W {
            const int64_t c = c0 + i;
            // +0.0 (as F.pad writes) on the border (a zero border: the reflected and repeated ones have a source)
            if (src == nullptr || !inside_w || c >= a.channels) return W(0);
            if constexpr (V::kNorm) {
              return bits_of(values.template value<T>(reinterpret_cast<const T*>(src)[c * stride_c + sw], rs,
                                                      values.template channel<T>(c)));
            } else {
              return src[c * stride_c + sw];
            }
          },
          [&](unsigned i, W v) {
            const int64_t w = w0 + i;
            if (leave && w >= a.pad_w0 && w < a.pad_w0 + a.width) return;
            if (w < out_w && c_write < a.channels) out[(r * out_w + w) * a.channels + c_write] = v;
          });
    }
  }
}

template <typename T, bool kModes>
__global__ void __launch_bounds__(kTile * kTileRows) causal_pad_cl_kernel(const CausalPadArgs a) {
  using W = typename Word<sizeof(T)>::type;
  __shared__ W tile[kTile][kTile + 1];  // [channel][column], padded against bank conflicts
  pad_cl_tiles<T, kModes>(a, shared_address(&tile[0][0]), CopyValues{});
}

// LTX-Video's VAE norm and the SiLU after it (ltx_vae_rmsnorm.cu's pair: the resnets' norm -> nonlinearity, the
// encoder's and decoder's norm_out -> conv_act) written as the padded channels-last input of the causal convolution
// that reads them (ops/ltx_vae_rmsnorm_conv.py): causal_pad_cl_kernel's copy of x with its frames repeated in time
// (a.replicate_t; with a.reflect_hw the rows and columns reflected), each value of x replaced as it is read by
// ltx_rmsnorm_value of it and its position's `rsqrt` (contiguous fp32 [batch, frames * height * width]: aten's
// torch.rsqrt(mean + eps), which eager multiplies by), with the SiLU. Every element of the buffer is the value the
// pair kernel computes for its source position (the same device function on the same operands), placed where
// causal_pad would copy it; a repeated frame's values are computed again from the same operands (the same bits). One
// read of x and one write of the buffer, where the pair kernel and causal_pad_cl_kernel read and write it twice. No
// cache (a.cache_frames 0).
template <typename T>
__global__ void __launch_bounds__(kTile * kTileRows) ltx_rmsnorm_pad_cl_kernel(const CausalPadArgs a,
                                                                               const float* rsqrt) {
  using W = typename Word<sizeof(T)>::type;
  __shared__ W tile[kTile][kTile + 1];
  pad_cl_tiles<T, true>(a, shared_address(&tile[0][0]), LtxNormValues{rsqrt});
}

// Wan's and Qwen-Image's VAE channel norm and the SiLU after it (channel_rmsnorm_silu.cu's pair: the residual blocks'
// norm -> nonlinearity, the encoder's and decoder's norm_out -> nonlinearity) written as the padded channels-last input
// of the causal convolution that reads them (ops/channel_rmsnorm_silu.py's padded result): causal_pad_cl_kernel's copy
// of x with its zero border (no cache: the convolution writes its cache frames, and zeros before them, into the
// buffer's first frames, which this kernel leaves unwritten inside the border: ChannelNormValues::kLeavesFront), each
// value of x replaced as it is read by channel_rmsnorm_value of it, its position's `denom` (contiguous fp32 [batch,
// frames * height * width]: aten's norm, which eager divides by) and its channel's gamma and bias (or `bias_value`),
// with the SiLU. Every element of x's frames in the buffer is the value the pair kernel computes for its position (the
// same device function on the same operands), placed where causal_pad would copy it: one read of x and one write of the
// buffer, where the pair kernel and causal_pad_cl_kernel read and write it twice.
template <typename T>
__global__ void __launch_bounds__(kTile * kTileRows) channel_rmsnorm_pad_cl_kernel(const CausalPadArgs a,
                                                                                   const float* denom,
                                                                                   const void* gamma,
                                                                                   const void* bias, float scale,
                                                                                   float bias_value) {
  using W = typename Word<sizeof(T)>::type;
  __shared__ W tile[kTile][kTile + 1];
  pad_cl_tiles<T, false>(a, shared_address(&tile[0][0]), ChannelNormValues{denom, gamma, bias, scale, bias_value});
}

// The wide channels-last copy: what pad_cl_tiles writes, moved 16 bytes at a time both ways (elementwise.cuh's
// transpose_tile_wide), where every vector is whole: 16-bit values, channels and width multiples of 8, x's (and the
// cache's) strides multiples of 8 elements and their data (and a norm's per-position operands) 16-byte aligned
// (wide_fits below, and ops/causal_conv_pad.py's twin). A block moves a tile of kWideChannels channels x kWideColumns
// source columns of one output row (b, t, h): each thread loads two 16-byte vectors (8 columns of one channel: source
// columns sw .. sw + 7 of the plane the row reads), and stores two (8 channels of one column: output column pad_w0 +
// sw, 64 contiguous bytes); a row that reads no plane (the zero frames and rows of the border) is stored as zeros
// without the tile. The border columns (below pad_w0 and from pad_w0 + width: zeros, or with a.reflect_hw the reflected
// source column's values) are written by the first column tile's block, 8 channels a thread, read one by one. Every
// element of the buffer is the one pad_cl_tiles writes there (a norm: the same value of the same operands). grid
// (ceil(width / kWideColumns), min(ceil(C / kWideChannels), 65535), min(B * Tp * Hp, 65535)), block kWideThreads, the
// channel tiles and rows with grid strides as pad_cl_tiles's.
constexpr int kWideChannels = 32;
constexpr int kWideColumns = 64;
constexpr int kWideThreads = 128;
constexpr int kWideVecs = kWideChannels * kWideColumns / 8 / kWideThreads;  // 16-byte vectors a thread moves

template <typename T, bool kModes, typename V>
__device__ __forceinline__ void pad_cl_wide_tiles(const CausalPadArgs& a, unsigned base, const V& values) {
  using P = Pack<T>;
  const int64_t out_w = a.width + a.pad_w0 + a.pad_w1;
  const int64_t out_h = a.height + a.pad_h0 + a.pad_h1;
  const int64_t out_t = a.pad_t0 + a.cache_frames + a.frames + a.pad_t1;
  const int64_t rows = a.batch * out_t * out_h;
  const int64_t s0 = static_cast<int64_t>(blockIdx.x) * kWideColumns;  // the tile's first source column
  const int64_t border = a.pad_w0 + a.pad_w1;
  T* out = static_cast<T*>(a.out);
  // A norm runs where the vectors are stored, on the values the tile brought (their bits as loaded): each stored
  // vector is one position (one operand of `per_position`, where each loaded vector needed eight) of 8 channels (their
  // operands read there, from the cache: held for the whole row they took the registers that kept fewer blocks in
  // flight), and the loads go to the tile with nothing between them and the stores (on an H100 at 1x96x4x480x832:
  // 0.78 ms where the norm on the load side took 0.96; docs/results.md, session 43).
  for (int64_t c0 = static_cast<int64_t>(blockIdx.y) * kWideChannels; c0 < a.channels;
       c0 += static_cast<int64_t>(gridDim.y) * kWideChannels) {  // (uniform over the block: __syncthreads is safe)
    for (int64_t r = blockIdx.z; r < rows; r += gridDim.z) {
      const SourceRow<T, kModes> row(a, r, out_h, out_t);
      const T* src = row.src;  // the source plane (b, st) at row sh, or none (the border)
      const int64_t stride_c = row.stride_c;
      // a norm's operands of the source row's positions (x's: no cache there)
      const float* rs_row = V::kNorm && src != nullptr
                                ? values.per_position +
                                      ((row.b * a.frames + row.st - a.cache_frames) * a.height + row.sh) * a.width
                                : nullptr;
      if (src == nullptr) {  // a row of zeros (uniform over the block): no tile, 16-byte stores of +0.0
        // (a kLeavesFront policy's frames before x's: only the border columns below)
        if (!(V::kLeavesFront && row.front(a))) {
          for (int i = threadIdx.x; i < kWideColumns * kWideChannels / 8; i += kWideThreads) {
            const int64_t sw = s0 + i / (kWideChannels / 8), c = c0 + 8 * (i % (kWideChannels / 8));
            if (sw < a.width && c < a.channels) {
              store_pack(out + (r * out_w + a.pad_w0 + sw) * a.channels + c, P{});
            }
          }
        }
      } else {
        float rs[kWideVecs];  // a norm's operand of the position (the tile column) each stored vector is
        if constexpr (V::kNorm) {
#pragma unroll
          for (int j = 0; j < kWideVecs; ++j) {
            const int64_t sw = s0 + (threadIdx.x + kWideThreads * j) / (kWideChannels / 8);
            rs[j] = sw < a.width ? __ldg(rs_row + sw) : 0.0f;
          }
        }
        transpose_tile_wide<T, kWideChannels, kWideColumns, kWideThreads>(
            base,
            [&](int, int cl, int sc) -> P {  // channel c0 + cl, source columns s0 + sc .. + 7
              const int64_t c = c0 + cl, sw = s0 + sc;
              return c < a.channels && sw < a.width ? load_readonly(reinterpret_cast<const P*>(src + c * stride_c + sw))
                                                    : P{};
            },
            [&](int, P p) -> P { return p; },
            [&](int j, int sc, int cl, P p) {  // source column s0 + sc: output column pad_w0 + s0 + sc
              const int64_t sw = s0 + sc, c = c0 + cl;
              if (sw < a.width && c < a.channels) {
                if constexpr (V::kNorm) {
#pragma unroll
                  for (int k = 0; k < 8; ++k) {
                    p.v[k] = values.template value<T>(p.v[k], rs[j], values.template channel<T>(c + k));
                  }
                }
                store_pack(out + (r * out_w + a.pad_w0 + sw) * a.channels + c, p);
              }
            });
      }
      if (blockIdx.x == 0) {  // the border columns of this row and channel tile
        for (int64_t i = threadIdx.x; i < border * (kWideChannels / 8); i += kWideThreads) {
          const int64_t bw = i / (kWideChannels / 8), c = c0 + 8 * (i % (kWideChannels / 8));
          if (c >= a.channels) continue;
          const int64_t w = bw < a.pad_w0 ? bw : a.width + bw;  // (pad_w0 + width + (bw - pad_w0))
          P p{};
          if constexpr (kModes) {
            if (a.reflect_hw && src != nullptr) {
              const int64_t sw = reflect_index(w - a.pad_w0, a.width);
#pragma unroll
              for (int k = 0; k < 8; ++k) {
                p.v[k] = src[(c + k) * stride_c + sw];
                if constexpr (V::kNorm) {
                  p.v[k] = values.template value<T>(p.v[k], __ldg(rs_row + sw), values.template channel<T>(c + k));
                }
              }
            }
          }
          store_pack(out + (r * out_w + w) * a.channels + c, p);
        }
      }
    }
  }
}

template <typename T, bool kModes>
__global__ void __launch_bounds__(kWideThreads) causal_pad_cl_wide_kernel(const CausalPadArgs a) {
  __shared__ __align__(16) unsigned short tile[kWideChannels * (kWideColumns + 2)];
  pad_cl_wide_tiles<T, kModes>(a, shared_window(&tile[0]), CopyValues{});
}

template <typename T>
__global__ void __launch_bounds__(kWideThreads) ltx_rmsnorm_pad_cl_wide_kernel(const CausalPadArgs a,
                                                                               const float* rsqrt) {
  __shared__ __align__(16) unsigned short tile[kWideChannels * (kWideColumns + 2)];
  pad_cl_wide_tiles<T, true>(a, shared_window(&tile[0]), LtxNormValues{rsqrt});
}

// (__maxnreg__ in place of __launch_bounds__, which cannot go with it: the registers of the build measured in session
// 43, 0.78 ms at 1x96x4x480x832 on an H100; ptxas's own choice for this code is 72 and 8 bytes spilled)
template <typename T>
__global__ void __maxnreg__(80) channel_rmsnorm_pad_cl_wide_kernel(const CausalPadArgs a, const float* denom,
                                                                   const void* gamma, const void* bias, float scale,
                                                                   float bias_value) {
  __shared__ __align__(16) unsigned short tile[kWideChannels * (kWideColumns + 2)];
  pad_cl_wide_tiles<T, false>(a, shared_window(&tile[0]), ChannelNormValues{denom, gamma, bias, scale, bias_value});
}

#ifndef __CUDACC_RTC__  // the host launcher; NVRTC builds only the kernels above (ops/_nvrtc.py launches them)
int64_t planes_of(const CausalPadArgs& a) {
  return a.batch * (a.pad_t0 + a.cache_frames + a.frames + a.pad_t1) * (a.height + a.pad_h0 + a.pad_h1);
}

// the channels-last kernels' grid (above): `columns` in tiles of `column_tile`, the channels in tiles of
// `channel_tile`, the output rows
dim3 tile_grid(const CausalPadArgs& a, int64_t columns, int column_tile, int channel_tile) {
  const int64_t planes = planes_of(a);
  const int64_t ctiles = (a.channels + channel_tile - 1) / channel_tile;
  return dim3(static_cast<unsigned>((columns + column_tile - 1) / column_tile),
              static_cast<unsigned>(ctiles < kMaxRowBlocks ? ctiles : kMaxRowBlocks),
              static_cast<unsigned>(planes < kMaxRowBlocks ? planes : kMaxRowBlocks));
}
// the tiled kernels' (every output column) and the wide kernels' (the source columns; the border is the first tile's)
dim3 cl_grid(const CausalPadArgs& a) { return tile_grid(a, a.width + a.pad_w0 + a.pad_w1, kTile, kTile); }
dim3 wide_grid(const CausalPadArgs& a) { return tile_grid(a, a.width, kWideColumns, kWideChannels); }

// The wide kernels' inputs (16-bit values: the callers' dtype): whole 16-byte vectors of x, of the cache and of a
// norm's per-position operands `rsqrt` (null: none) at every row the tiles read, and of the output at every column
// (ops/causal_conv_pad.py's wide_fits is its Python twin).
bool wide_fits(const CausalPadArgs& a, const float* rsqrt) {
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  bool fits = a.channels % 8 == 0 && a.width > 0 && a.width % 8 == 0 && aligned(a.x) && aligned(a.out) &&
              a.x_stride_b % 8 == 0 && a.x_stride_c % 8 == 0 && a.x_stride_t % 8 == 0 && a.x_stride_h % 8 == 0;
  if (a.cache_frames > 0) {
    fits = fits && aligned(a.cache) && a.cache_stride_b % 8 == 0 && a.cache_stride_c % 8 == 0 &&
           a.cache_stride_t % 8 == 0 && a.cache_stride_h % 8 == 0;
  }
  return fits && (rsqrt == nullptr || aligned(rsqrt));
}

template <typename T, bool kModes>
cudaError_t launch(const CausalPadArgs& a, cudaStream_t stream) {
  const int64_t out_w = a.width + a.pad_w0 + a.pad_w1;
  const int64_t planes = planes_of(a);
  const int64_t rows = planes * a.channels;
  if (rows == 0 || out_w == 0) return cudaSuccess;
  if (rows < 0 || out_w < 0) return cudaErrorInvalidValue;
  if (a.channels_last) {
    if constexpr (sizeof(T) == 2) {
      if (wide_fits(a, nullptr)) {
        causal_pad_cl_wide_kernel<T, kModes><<<wide_grid(a), kWideThreads, 0, stream>>>(a);
        return cudaGetLastError();
      }
    }
    causal_pad_cl_kernel<T, kModes><<<cl_grid(a), dim3(kTile, kTileRows), 0, stream>>>(a);
    return cudaGetLastError();
  }
  const dim3 grid(static_cast<unsigned>((out_w + kThreads - 1) / kThreads),
                  static_cast<unsigned>(rows < kMaxRowBlocks ? rows : kMaxRowBlocks));
  causal_pad_kernel<T, kModes><<<grid, kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_norm(const CausalPadArgs& a, const float* rsqrt, cudaStream_t stream) {
  const int64_t out_w = a.width + a.pad_w0 + a.pad_w1;
  const int64_t rows = planes_of(a) * a.channels;
  if (rows == 0 || out_w == 0) return cudaSuccess;
  if (rows < 0 || out_w < 0 || !a.channels_last || !a.replicate_t || a.cache_frames) return cudaErrorInvalidValue;
  if (wide_fits(a, rsqrt)) {
    ltx_rmsnorm_pad_cl_wide_kernel<T><<<wide_grid(a), kWideThreads, 0, stream>>>(a, rsqrt);
    return cudaGetLastError();
  }
  ltx_rmsnorm_pad_cl_kernel<T><<<cl_grid(a), dim3(kTile, kTileRows), 0, stream>>>(a, rsqrt);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_channel_norm(const CausalPadArgs& a, const float* denom, const void* gamma, const void* bias,
                                float scale, float bias_value, cudaStream_t stream) {
  const int64_t out_w = a.width + a.pad_w0 + a.pad_w1;
  const int64_t rows = planes_of(a) * a.channels;
  if (rows == 0 || out_w == 0) return cudaSuccess;
  if (rows < 0 || out_w < 0 || !a.channels_last || a.replicate_t || a.reflect_hw || a.cache_frames) {
    return cudaErrorInvalidValue;
  }
  if (wide_fits(a, denom)) {
    channel_rmsnorm_pad_cl_wide_kernel<T><<<wide_grid(a), kWideThreads, 0, stream>>>(a, denom, gamma, bias, scale,
                                                                                      bias_value);
    return cudaGetLastError();
  }
  channel_rmsnorm_pad_cl_kernel<T><<<cl_grid(a), dim3(kTile, kTileRows), 0, stream>>>(a, denom, gamma, bias, scale,
                                                                                       bias_value);
  return cudaGetLastError();
}
#endif  // __CUDACC_RTC__

}  // namespace

#ifndef __CUDACC_RTC__
cudaError_t launch_causal_pad(const CausalPadArgs& args, cudaStream_t stream) {
  return dispatch_storage_or_float(args.dtype, [&](auto tag) {
    // (the zero border alone: the instantiation that does not read the mode flags)
    return args.replicate_t || args.reflect_hw ? launch<decltype(tag), true>(args, stream)
                                               : launch<decltype(tag), false>(args, stream);
  });
}

cudaError_t launch_ltx_rmsnorm_pad_cl(const CausalPadArgs& args, const float* rsqrt, cudaStream_t stream) {
  return dispatch_storage_type(args.dtype, [&](auto tag) { return launch_norm<decltype(tag)>(args, rsqrt, stream); });
}

cudaError_t launch_channel_rmsnorm_pad_cl(const CausalPadArgs& args, const float* denom, const void* gamma,
                                         const void* bias, float scale, float bias_value, cudaStream_t stream) {
  return dispatch_storage_type(args.dtype, [&](auto tag) {
    return launch_channel_norm<decltype(tag)>(args, denom, gamma, bias, scale, bias_value, stream);
  });
}
#endif

}  // namespace diffusers_fastpath
