// Q8_0 matrix products on the tensor cores for T = 1..16 rows of x (q8_mma.py compiles this with NVRTC):
//
//   out [T, N] float32 = x [T, G*K] float32 @ W.T,   W [N, K] as q8_triton.split_q8's arrays:
//   quants u8 [N, KP] (u = q + 128; in each span of 8 blocks word j of block b at word 8*j + b), scales f16 [N, KP/32]
//
// One warp computes MT tiles of 16 rows with mma.sync.m16n8k16 (f16 operands, float32 accumulation), the weights as
// the A operand, x as B (NT tiles of 8 x rows). A lane's A fragment of a 16-value k step is words of split_q8's
// arrangement loaded 16 bytes at a time and never moved between lanes: in k step h of block b, lane (g = lane / 4,
// t = lane % 4) holds word t + 4h of block b of rows g and g + 8 (4 values each), and the k slots of the fragment
// {2t, 2t+1, 2t+8, 2t+9} stand for that word's values 0..3; x's B fragment is read in the same order, so each k step
// sums the products of values 16h..16h+15 of the block (in another order). A word's bytes become exact float16
// integers q by two byte permutes (0x64 above each byte: 1024 + u) and two packed subtractions of 1152.
// x is exact enough as two float16 parts: each x row of the program's K range divided by the power of two s above
// its largest |value| (exact), hi = f16(x / s), lo = f16(x / s - hi); a block's 32 values are four mma (2 k steps
// x hi / lo) into float32, then scaled by the block's d into the accumulators, and the accumulators by s at the end.
// Products q * hi are exact (8 x 11 bits); hi + lo leave ~2^-23 of the row's largest |x|.
//
// Grid (row tiles of ROWS rows, K splits of `spans` spans each): a program converts its x range to float16 parts in
// shared memory once, then streams its rows' quants and scales. With several splits each program stores its partials
// in part[split] and counts itself in cnt[tile]; the last of a tile's programs adds the partials in split order
// (deterministic), writes out and sets cnt[tile] back to 0 (q8_triton's scheme and counters).
//
// Compile-time: NT (x tiles of 8 rows: 1 for T <= 8, 2 for T <= 16), MT (16-row tiles per warp), WARPS, PF (1: the
// next span's loads issued before this span's products; the first span's are always issued before x is prepared).

#include "ptx_ops.cuh"

#define SPAN 256                              // values of a span (8 Q8_0 blocks)
#define ROWS (WARPS * MT * 16)                // weight rows of a program
#define XROWS (8 * NT)                        // x rows in shared memory (the real T of them, then zeros)

__device__ __forceinline__ u32 word_of(uint4 v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

__device__ __forceinline__ void zero(float (&a)[MT][NT][4]) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                a[mt][nt][e] = 0.f;
}

// One span of a warp's rows in registers: words t and t + 4 of the 8 blocks of rows g and g + 8 of each tile, and
// the rows' 8 scales.
struct Span {
    uint4 w[MT][2][4];                        // [tile][row g, g + 8][word t: blocks 0-3, 4-7; word t + 4: 0-3, 4-7]
    uint4 d[MT][2];                           // f16 scales of blocks 0..7, rows g and g + 8
};

// BEFORE_WAIT: the loads stay before pdl_enter's wait (the first span's, ldg_before_wait)
template <bool BEFORE_WAIT = false>
__device__ __forceinline__ void load_span(Span& sp, const unsigned char* __restrict__ quants,
                                          const u16* __restrict__ scales, int wrow0, int g, int t, int N, int KP,
                                          int span) {
    auto ld = [](const uint4* p) { return BEFORE_WAIT ? ldg_before_wait(p) : __ldg(p); };
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = min(wrow0 + mt * 16 + g + 8 * r, N - 1);
            const uint4* q = (const uint4*)(quants + (long long)row * KP + (long long)span * SPAN);
            sp.w[mt][r][0] = ld(q + 2 * t);                        // bytes 32t..32t+31: word t of blocks 0..7
            sp.w[mt][r][1] = ld(q + 2 * t + 1);
            sp.w[mt][r][2] = ld(q + 2 * t + 8);                    // word t + 4 of blocks 0..7
            sp.w[mt][r][3] = ld(q + 2 * t + 9);
            sp.d[mt][r] = ld((const uint4*)(scales + (long long)row * (KP / 32) + (long long)span * 8));
        }
}

// acc[tile][x tile] += the span's products: xs the span's x parts in shared memory (rows of `stride` bytes)
__device__ __forceinline__ void mul_span(float (&acc)[MT][NT][4], const Span& sp, const unsigned char* xs,
                                         int stride, int g, int t, u32 hi_bytes) {
#pragma unroll
    for (int b = 0; b < 8; ++b) {
        float c[MT][NT][4];                   // the block's sums before its scale
        zero(c);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            uint4 xb[NT];                     // x rows 8nt + g, values 4(t + 4h)..+3 of block b: hi pair x 2, lo x 2
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
                xb[nt] = *(const uint4*)(xs + (8 * nt + g) * stride + (8 * b + 4 * h + t) * 16);
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                const u32 w0 = word_of(sp.w[mt][0][2 * h + b / 4], b % 4);
                const u32 w1 = word_of(sp.w[mt][1][2 * h + b / 4], b % 4);
                const u32 a0 = sub_f16x2(prmt(w0, hi_bytes, 0x4140), 0x64806480u);      // row g, values 0, 1
                const u32 a1 = sub_f16x2(prmt(w1, hi_bytes, 0x4140), 0x64806480u);      // row g + 8
                const u32 a2 = sub_f16x2(prmt(w0, hi_bytes, 0x4342), 0x64806480u);      // row g, values 2, 3
                const u32 a3 = sub_f16x2(prmt(w1, hi_bytes, 0x4342), 0x64806480u);
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    mma(c[mt][nt], a0, a1, a2, a3, xb[nt].x, xb[nt].y);
                    mma(c[mt][nt], a0, a1, a2, a3, xb[nt].z, xb[nt].w);
                }
            }
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            const float dg = f16_to_f32((u16)(word_of(sp.d[mt][0], b / 2) >> (16 * (b % 2))));
            const float d8 = f16_to_f32((u16)(word_of(sp.d[mt][1], b / 2) >> (16 * (b % 2))));
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                acc[mt][nt][0] += c[mt][nt][0] * dg;
                acc[mt][nt][1] += c[mt][nt][1] * dg;
                acc[mt][nt][2] += c[mt][nt][2] * d8;
                acc[mt][nt][3] += c[mt][nt][3] * d8;
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(WARPS * 32)
q8_mma(const float* __restrict__ x, const unsigned char* __restrict__ quants, const u16* __restrict__ scales,
       float* __restrict__ out, float* __restrict__ part, int* __restrict__ cnt, int T, int N, int rows_per_group,
       int K, int KP, int spans, int splits, u32 hi_bytes) {
    // hi_bytes: 0x64646464, an argument so that ptxas keeps it in a register and each PRMT takes its selector as the
    // immediate (as a literal, ptxas made it the immediate and moved each selector into a register: a move per PRMT)
    extern __shared__ __align__(16) unsigned char smem[];
    const int stride = spans * 1024 + 64;     // bytes of an x row: 16 per 4 values (hi x 4, lo x 4), +64: no conflicts
    float* xscale = (float*)(smem + XROWS * stride);                             // [XROWS] s of each x row
    int* last = (int*)(xscale + XROWS);

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int row0 = blockIdx.x * ROWS, wrow0 = row0 + warp * MT * 16;
    const int span0 = blockIdx.y * spans, k0 = span0 * SPAN;                    // first span and value of the range
    const long long GK = (long long)K * (N / rows_per_group);                   // x's row length
    const float* xg = x + (long long)(row0 / rows_per_group) * K;               // this program's group of inputs
    const int groups4 = spans * (SPAN / 4);                                     // 4-value groups of the range

    Span cur;                                 // the first span's loads, in flight while x is prepared: before the
    load_span<true>(cur, quants, scales, wrow0, g, t, N, KP, span0);     // wait for the kernel before (weights,
    pdl_enter();                                                           // which no kernel of a step writes)

    // 1. s of each x row: the power of two above its largest |value| in the range (1 for all-zero or non-finite;
    //    NaN and infinities reach the products through the parts)
    for (int n = warp; n < T; n += WARPS) {
        float m = 0.f;
        for (int i = lane; i < groups4; i += 32) {
            const int k = k0 + 4 * i;
            if (k < K) {
                const float4 v = *(const float4*)(xg + n * GK + k);
                m = fmaxf(m, fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
            }
        }
        for (int o = 16; o > 0; o >>= 1)
            m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        if (lane == 0) {
            int e = 0;
            if (m > 0.f && m <= 3.402823466e38f)
                frexpf(m, &e);                                                  // m in [2^(e-1), 2^e)
            xscale[n] = ldexpf(1.f, max(-125, min(e, 127)));     // s and 1 / s normal (then m / s may be < 1/2)
        }
    }
    __syncthreads();

    // 2. x / s as float16 hi and lo parts, 16 bytes per 4 values: [hi0 hi1 hi2 hi3 lo0 lo1 lo2 lo3]
    for (int i = tid; i < XROWS * groups4; i += WARPS * 32) {
        const int n = i / groups4, grp = i - n * groups4, k = k0 + 4 * grp;
        float v[4] = {0.f, 0.f, 0.f, 0.f};
        if (n < T && k < K) {
            const float4 f = *(const float4*)(xg + n * GK + k);
            const float inv = 1.f / xscale[n];                                  // a power of two: exact
            v[0] = f.x * inv, v[1] = f.y * inv, v[2] = f.z * inv, v[3] = f.w * inv;
        }
        u16 h[8];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            h[j] = f32_to_f16(v[j]);
            h[4 + j] = f32_to_f16(v[j] - f16_to_f32(h[j]));
        }
        uint4 packed;
        packed.x = h[0] | ((u32)h[1] << 16), packed.y = h[2] | ((u32)h[3] << 16);
        packed.z = h[4] | ((u32)h[5] << 16), packed.w = h[6] | ((u32)h[7] << 16);
        *(uint4*)(smem + n * stride + grp * 16) = packed;
    }
    __syncthreads();

    // 3. the products, span by span (with PF the next span's loads in flight during a span's products)
    float acc[MT][NT][4];
    zero(acc);
    for (int s = 0; s < spans; ++s) {
#if PF
        Span next;
        if (s + 1 < spans)
            load_span(next, quants, scales, wrow0, g, t, N, KP, span0 + s + 1);
        mul_span(acc, cur, smem + s * 1024, stride, g, t, hi_bytes);
        cur = next;
#else
        if (s > 0)
            load_span(cur, quants, scales, wrow0, g, t, N, KP, span0 + s);
        mul_span(acc, cur, smem + s * 1024, stride, g, t, hi_bytes);
#endif
    }

    // 4. out[n, row] (accumulator e of a lane: row g + 8 * (e / 2), x row 8nt + 2t + e % 2), times s of its x row
    float* dst = splits == 1 ? out : part + (long long)blockIdx.y * T * N;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int row = wrow0 + mt * 16 + g + 8 * (e / 2), n = 8 * nt + 2 * t + e % 2;
                if (n < T && row < N)
                    dst[(long long)n * N + row] = acc[mt][nt][e] * xscale[n];
            }
    if (splits == 1)
        return;
    __threadfence();                          // this thread's partials are visible before the count (release)
    __syncthreads();
    if (tid == 0)
        *last = atomicAdd(cnt + blockIdx.x, 1) == splits - 1;
    __syncthreads();
    if (!*last)
        return;
    __threadfence();                          // (acquire) the other programs' partials, read from L2 below
    for (int i = tid; i < T * ROWS; i += WARPS * 32) {
        const int n = i / ROWS, row = row0 + i - n * ROWS;
        if (row < N) {
            float total = 0.f;
            for (int sp = 0; sp < splits; ++sp)
                total += __ldcg(part + ((long long)sp * T + n) * N + row);
            out[(long long)n * N + row] = total;
        }
    }
    if (tid == 0)
        atomicExch(cnt + blockIdx.x, 0);
}
