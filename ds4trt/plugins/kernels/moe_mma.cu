// The routed experts of a long call (a prefill chunk) on the tensor cores, for ds4's q2 mix (moe_mma.py compiles this
// with NVRTC): the IQ2_XXS gate / up (moe_gateup_iq2) and, further down, the Q2_K down (moe_down_q2k), on mma.sync;
// at the end both again on wgmma (moe_gateup_iq2_wg, moe_down_q2k_wg: Hopper's sm_90a, built with WG=1)
//
//   h[pair, rows] = weight[pair] * swiglu(gate_e x_t, up_e x_t)     for the pairs (token t, expert e) of an item
//   y[pair, rows] = down_e h[pair]
//
// Items as moe_triton._long_items lists them: starts[i] is the sorted position of item i, its pairs order[start
// .. start + cnt[start]) (1..CAP pairs of one expert; a start whose cnt is 0 pads the list: its programs return).
// Grid (items, F / ROWS); a program serves one item and ROWS rows of F, each warp 16 rows of gate and the same 16 of
// up, for all pairs of the item at once (CAP = 8 NT columns).
//
// x: q8_triton.x_f16's rows (float16 of x / s, s a power of two per token). Each chunk of 256 values of the item's
// tokens is copied into shared memory (cp.async, the next chunk's while this one's products run), 16-byte units
// permuted so that a lane's B fragments are one 16-byte read (x_unit).
//
// IQ2_XXS block (66 bytes: f16 d, then 8 records of (u32 A, u32 B), one per 32-value sub-block): value 8r + i of
// sub-block sb = d / 8 * (2s + 1) * grid[A byte r][i] * (bit i of ksigns[B bits 7r..7r+6] ? -1 : 1), s = B >> 28.
// Here the tensor cores get float16 values (2s + 1) d * grid * sign: grid * sign (exact float16 integers) from two
// shared tables, times the run's scale (2s + 1) d rounded to float16, so each value is rounded twice (2^-11 of it
// at most; >= d, so no subnormal unless d is); 1 / 8 and s are applied to the sums once, in float32, at the end. So
// the accumulators run over all blocks (no per-block partial sums to scale: half the accumulators; at two programs an
// SM, CAP 64's fused gate/up spills 56 bytes, loaded back 296 bytes a thread, where it spilled 780). Two forms (NIB):
//   NIB 1: tables of 32-bit words: each grid entry's 2-bit codes as nibbles (value i at bits 4i), each sign index's
//          bits at bit 2 of those nibbles, so that codes | signs selects, by two byte permutes, each value's 128 +-
//          magnitude from an 8-byte table of them; a third permute and a packed subtraction of 1152 make float16 pairs
//          (as q8_mma.cu), a packed multiply the scale. A run: 2 4-byte table reads, ~15 operations.
//   NIB 0: tables of 16-byte rows: the grid's magnitudes as float16, the signs as 0x8000 masks: one packed multiply
//          and one xor per pair. A run: 2 16-byte table reads, ~8 operations. A warp's 16-byte reads of random rows
//          conflict within each shared-memory pass of 8 lanes; its 4-byte reads share one pass of 32 lanes: NIB 1
//          needs fewer passes for more operations.
//
// Fragments (mma.m16n8k16, lane = 4 g + t): in the block's k step (h, r, half) lane t holds values 4 half .. 4 half +
// 3 of run r of sub-block t + 4h, rows g and g + 8 (a0, a2 row g; a1, a3 row g + 8), and x's same 4 values of token
// column g (b0, b1): the 16 k slots of a step are 4 lanes' runs of different sub-blocks, which is no matter, since A
// and B agree on them. So a lane reads only its own two records of a row per block.
//
// Compile-time: NT (x tiles of 8 pairs: CAP = 8 NT), WARPS, NIB (the gate/up's table form), FUSE (1: gate and up in
// one pass over a block, each x fragment read once for both: half the x reads from shared memory, twice the
// accumulators; 0: one matrix after the other), MINB (programs per SM the registers must allow: __launch_bounds__).

#include "ptx_ops.cuh"

#define CAP (8 * NT)
#define ROWS (WARPS * 16)
#define XSTRIDE 576                           // bytes of a token's 256 float16 in shared memory (+64: no conflicts)
#define IQ2_BYTES 66

__device__ __forceinline__ void zero(float (&a)[NT][4]) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
            a[nt][e] = 0.f;
}

// acc += d * inv[column] * c, d = dg for row g (accumulators 0, 1), d8 for row g + 8 (2, 3); inv of columns 2t, 2t + 1
// of each x tile
__device__ __forceinline__ void add_scaled(float (&acc)[NT][4], const float (&c)[NT][4], float dg, float d8,
                                           const float* inv, int t) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        const float i0 = inv[8 * nt + 2 * t], i1 = inv[8 * nt + 2 * t + 1];
        acc[nt][0] += dg * i0 * c[nt][0];
        acc[nt][1] += dg * i1 * c[nt][1];
        acc[nt][2] += d8 * i0 * c[nt][2];
        acc[nt][3] += d8 * i1 * c[nt][3];
    }
}

// rows s >= n of both buffers of a [2][CAP][stride bytes] array set to zero, `units` 16-byte units of each: the slots
// past the item's pairs read as zeros (the copies never write them)
__device__ __forceinline__ void zero_dead_slots(unsigned char* buf, int stride, int units, int n, int tid) {
    for (int i = tid; i < 2 * CAP * units; i += WARPS * 32) {
        const int row = i / units;
        if (row % CAP >= n)
            *(uint4*)(buf + row * stride + (i % units) * 16) = uint4{0u, 0u, 0u, 0u};
    }
}

// The loop over K's blocks: stage(blk) issues block blk's copies into buffer blk & 1 (one cp.async group); body(blk)
// runs when they have landed, with the next block's copies in flight. A buffer is overwritten only after the barrier
// that ends the last body reading it.
// ASYNC_READS: the body's tensor cores read the buffer through the async proxy (wgmma), so each thread fences its
// landed copies before the barrier.
template <bool ASYNC_READS = false, typename Stage, typename Body>
__device__ __forceinline__ void pipelined_blocks(int nsb, Stage&& stage, Body&& body) {
    stage(0);
    for (int blk = 0; blk < nsb; ++blk) {
        if (blk + 1 < nsb) {
            stage(blk + 1);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
#if WG
        if (ASYNC_READS)
            fence_proxy_async();
#endif
        __syncthreads();
        body(blk);
        __syncthreads();
    }
}

// store(s, row, e) for each accumulator e of each x tile whose column (pair slot) s < n: accumulator e of a lane is
// row g + 8 * (e / 2) of the warp's tile, column 2t + e % 2 of its x tile
template <typename Store>
__device__ __forceinline__ void for_each_output(int n, int g, int t, Store&& store) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int s = 8 * nt + 2 * t + (e & 1);
            if (s < n)
                store(s, g + 8 * (e >> 1), nt, e);
        }
}

// where 16-byte unit q of a chunk (values 8q..8q+7: run q % 4 of sub-block q / 4) goes in shared memory: lane t's
// unit of step (h, r) is 16h + 4r + t
__device__ __forceinline__ int x_unit(int q) {
    const int sb = q >> 2;
    return 16 * (sb >> 2) + 4 * (q & 3) + (sb & 3);
}

// the record (A, B) of sub-block sb of the block at byte offset off (2-byte aligned) by aligned 4-byte reads
__device__ __forceinline__ void iq2_record(const unsigned char* __restrict__ w, long long off, int sb, u32& a, u32& b) {
    const long long p = off + 2 + 8 * sb;
    const u32* q = (const u32*)(w + (p & ~3LL));
    const u32 w0 = __ldg(q), w1 = __ldg(q + 1);
    if (p & 2) {
        const u32 w2 = __ldg(q + 2);
        a = prmt(w0, w1, 0x5432);
        b = prmt(w1, w2, 0x5432);
    } else {
        a = w0;
        b = w1;
    }
}

// the run scale (2s + 1) d of a record's B word, d its block's scale in float32, as float16 in both halves
__device__ __forceinline__ u32 run_scale(u32 b, float d) {
    const u32 h = f32_to_f16((float)(2 * (b >> 28) + 1) * d);
    return h | (h << 16);
}

#if NIB
typedef u32 TabRow;
#define TAB_BYTES (384 * 4)
// 128 + magnitude for codes 0, 1, 2 (bytes 0..2), 128 - magnitude with the sign nibble bit 2 set (bytes 4..6)
#define LUT_POS (136u | 153u << 8 | 171u << 16)
#define LUT_NEG (120u | 103u << 8 | 85u << 16)

// run r of a record: its 8 values (2s + 1) * grid * sign as float16 pairs v[j] = values 2j, 2j + 1
__device__ __forceinline__ void iq2_run(const TabRow* tab, u32 a, u32 b, u32 scale, int r, u32 (&v)[4]) {
    const u32 sel = tab[(a >> (8 * r)) & 255] | tab[256 + ((b >> (7 * r)) & 127)];
    const u32 lo = prmt(LUT_POS, LUT_NEG, sel), hi = prmt(LUT_POS, LUT_NEG, sel >> 16);   // 128 +- m, values 0..7
    v[0] = mul_f16x2(sub_f16x2(prmt(lo, 0x64646464u, 0x4140), 0x64806480u), scale);
    v[1] = mul_f16x2(sub_f16x2(prmt(lo, 0x64646464u, 0x4342), 0x64806480u), scale);
    v[2] = mul_f16x2(sub_f16x2(prmt(hi, 0x64646464u, 0x4140), 0x64806480u), scale);
    v[3] = mul_f16x2(sub_f16x2(prmt(hi, 0x64646464u, 0x4342), 0x64806480u), scale);
}
#else
typedef uint4 TabRow;
#define TAB_BYTES (384 * 16)
__device__ __forceinline__ void iq2_run(const TabRow* tab, u32 a, u32 b, u32 scale, int r, u32 (&v)[4]) {
    const uint4 m = tab[(a >> (8 * r)) & 255];
    const uint4 s = tab[256 + ((b >> (7 * r)) & 127)];
    v[0] = mul_f16x2(m.x, scale) ^ s.x;
    v[1] = mul_f16x2(m.y, scale) ^ s.y;
    v[2] = mul_f16x2(m.z, scale) ^ s.z;
    v[3] = mul_f16x2(m.w, scale) ^ s.w;
}
#endif

// acc[m][x tile] += 8 * (one block of matrix w[m], rows g, g + 8 at byte offsets og, o8, against the chunk xb) for
// m < M: with M = 2 (gate and up, FUSE) each x fragment read serves both matrices
template <int M>
__device__ __forceinline__ void block_product(float (*acc)[NT][4], const unsigned char* const* w, long long og,
                                              long long o8, const unsigned char* xb, const TabRow* tab, int g, int t) {
    float dg[M], d8[M];
#pragma unroll
    for (int m = 0; m < M; ++m) {
        dg[m] = f16_to_f32(__ldg((const u16*)(w[m] + og)));
        d8[m] = f16_to_f32(__ldg((const u16*)(w[m] + o8)));
    }
#pragma unroll 1
    for (int h = 0; h < 2; ++h) {
        u32 ag[M], bg[M], a8[M], b8[M], sg[M], s8[M];
#pragma unroll
        for (int m = 0; m < M; ++m) {
            iq2_record(w[m], og, t + 4 * h, ag[m], bg[m]);
            iq2_record(w[m], o8, t + 4 * h, a8[m], b8[m]);
            sg[m] = run_scale(bg[m], dg[m]);
            s8[m] = run_scale(b8[m], d8[m]);
        }
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            u32 vg[M][4], v8[M][4];
#pragma unroll
            for (int m = 0; m < M; ++m) {
                iq2_run(tab, ag[m], bg[m], sg[m], r, vg[m]);
                iq2_run(tab, a8[m], b8[m], s8[m], r, v8[m]);
            }
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const uint4 xv = *(const uint4*)(xb + (8 * nt + g) * XSTRIDE + (16 * h + 4 * r + t) * 16);
#pragma unroll
                for (int m = 0; m < M; ++m) {
                    mma(acc[m][nt], vg[m][0], v8[m][0], vg[m][1], v8[m][1], xv.x, xv.y);  // values 0..3 of the run
                    mma(acc[m][nt], vg[m][2], v8[m][2], vg[m][3], v8[m][3], xv.z, xv.w);  // values 4..7
                }
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(WARPS * 32, MINB)
moe_gateup_iq2(const u16* __restrict__ xh, const float* __restrict__ xscale, const long long* __restrict__ ids,
               const float* __restrict__ wts, const int* __restrict__ order, const int* __restrict__ cnt,
               const int* __restrict__ starts, const unsigned char* __restrict__ gate,
               const unsigned char* __restrict__ up, const TabRow* __restrict__ tables, float* __restrict__ h,
               int n_slots, int F, int D, float clamp) {
    // xh [R, D] float16 bits, xscale [R]: x_f16's rows and scales, a row per token; ids, wts [P]: each pair's
    // expert and weight; gate, up [E, F, D / 256 * 66] IQ2_XXS; tables [384]: 256 grid rows, 128 sign rows (NIB);
    // h [P, F] float32
    pdl_enter();
    extern __shared__ __align__(16) unsigned char smem[];
    unsigned char* xs = smem;                                   // [2][CAP][XSTRIDE]: two chunks of x
    TabRow* tab = (TabRow*)(smem + 2 * CAP * XSTRIDE);         // [384]
    long long* tokrow = (long long*)(smem + 2 * CAP * XSTRIDE + TAB_BYTES);   // [CAP] each slot's token row in xh
    float* sslot = (float*)(tokrow + CAP);                      // [CAP] each slot's s / 8
    float* wslot = sslot + CAP;                                 // [CAP]
    int* pslot = (int*)(wslot + CAP);                           // [CAP]

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int item = starts[blockIdx.x], n = cnt[item], nsb = D / 256;
    if (n < 1)                                                  // past the list's items (moe_triton._long_items)
        return;
    const long long row_bytes = (long long)nsb * IQ2_BYTES;
    const long long e = ids[order[item]];
    const int row0 = blockIdx.y * ROWS + warp * 16;             // this warp's 16 rows
    const long long og = (e * F + row0 + g) * row_bytes, o8 = og + 8 * row_bytes;

    for (int i = tid; i < 384; i += WARPS * 32)
        tab[i] = __ldg(tables + i);
    for (int s = tid; s < CAP; s += WARPS * 32) {
        const int pair = s < n ? order[item + s] : 0;
        pslot[s] = pair;
        wslot[s] = s < n ? wts[pair] : 0.f;
        sslot[s] = s < n ? xscale[pair / n_slots] * 0.125f : 0.f;
        tokrow[s] = s < n ? (long long)(pair / n_slots) * D : 0;
    }
    zero_dead_slots(xs, XSTRIDE, 32, n, tid);
    __syncthreads();

    auto stage = [&](int blk) {                                 // chunk blk of the item's tokens into buffer blk & 1
        unsigned char* xb = xs + (blk & 1) * CAP * XSTRIDE;
        for (int i = tid; i < n * 32; i += WARPS * 32) {
            const int s = i >> 5, q = i & 31;
            cp_async16(xb + s * XSTRIDE + x_unit(q) * 16, xh + tokrow[s] + blk * 256 + q * 8);
        }
        cp_async_commit();
    };

    float acc[2][NT][4];                                        // gate, up
    zero(acc[0]);
    zero(acc[1]);
    const unsigned char* const mats[2] = {gate, up};
    pipelined_blocks(nsb, stage, [&](int blk) {
        const unsigned char* xb = xs + (blk & 1) * CAP * XSTRIDE;
        const long long bg = og + blk * IQ2_BYTES, b8 = o8 + blk * IQ2_BYTES;
#if FUSE
        block_product<2>(acc, mats, bg, b8, xb, tab, g, t);
#else
        block_product<1>(acc, mats, bg, b8, xb, tab, g, t);
        block_product<1>(acc + 1, mats + 1, bg, b8, xb, tab, g, t);
#endif
    });
    for_each_output(n, g, t, [&](int s, int r, int nt, int e4) {
        const float gv = fminf(acc[0][nt][e4] * sslot[s], clamp);
        const float uv = fminf(fmaxf(acc[1][nt][e4] * sslot[s], -clamp), clamp);
        h[(long long)pslot[s] * F + row0 + r] = wslot[s] * (gv / (1.f + expf(-gv))) * uv;
    });
}

#if WG
// ---------------------------------------------------------------------------------------------------------------------
// moe_gateup_iq2_wg: the same products on wgmma (sm_90a; built with WG=1). Each warpgroup (4 warps) issues
// m64n(CAP)k16 products for its 64 rows: A the same per-warp float16 fragments as above, decoded in registers, B the
// k step's CAP x 16 tile of x in shared memory, read by the tensor cores themselves (no x fragment reads per 8
// columns, one instruction per 16 x CAP products a warp instead of CAP / 8). While one run's products run, the next
// run's values are decoded (their registers stay live until the wait that follows: pin).
//
// x comes in x_f16's wgmma order (q8_triton.x_f16(..., wgmma_order=True)): in each 256-value chunk, position
// 16 ks + 8 kc + 2 t + j holds value 32 (t + 4 h) + 8 r + 4 half + 2 kc + j, k step ks = 8 h + 2 r + half, so that
// the 16-byte unit u = 2 ks + kc of a token is the K half kc of its row of step ks: lanes t of the fragments above
// (k slots 2t, 2t + 1 and 8 + 2t, 8 + 2t + 1). In shared memory a step's tile is core matrices (8 tokens x 16
// bytes), token group after K half: unit (s, u) at wg_unit(s, u); descriptor lbo 128 (K), sbo 256 (N).

#define XS_STEP (CAP * 32)                    // bytes of one k step's tile: CAP tokens x 16 float16
#define XS_CHUNK (16 * XS_STEP)

__device__ __forceinline__ int wg_unit(int s, int u) {
    return (u >> 1) * XS_STEP + (s >> 3) * 256 + (u & 1) * 128 + (s & 7) * 16;
}

// One chunk's copies of the item's x (or h) into the k-step tiles (wg_unit), laid out once per program so that each
// chunk's are a cp.async each at addresses that move by constants (a runtime loop over the copies spent ~30 SASS
// instructions a copy on indices, 8 copies a thread a block at CAP 64). Per copy instruction a warp takes 8 tokens x 4
// consecutive units: two 32-byte sectors of each token's row, 4 core-matrix rows of shared memory. A thread keeps its
// P tokens (2 where CAP / 8 > WARPS) and first units; its Q units of each are DU apart.
struct TileCopies {
    static constexpr int GROUPS = CAP / 8, P = GROUPS > WARPS ? GROUPS / WARPS : 1, Q = CAP / (WARPS * P),
                         DU = 4 * WARPS * P / GROUPS;
    static_assert(GROUPS % WARPS == 0 || WARPS % GROUPS == 0, "TileCopies: whole token groups a warp");
    static_assert(Q * DU == 32 && DU % 2 == 0, "TileCopies: each token's 32 units once");
    const u16* src[P];                                          // a token's first unit in chunk 0; null: a dead slot
    int dst[P];                                                 // its byte offset in a chunk's tiles

    template <typename Row>                                     // row(s): slot s's row of 16-bit values
    __device__ __forceinline__ TileCopies(int tid, int n, Row&& row) {
        const int warp = tid >> 5, lane = tid & 31;
#pragma unroll
        for (int p = 0; p < P; ++p) {
            const int tau = warp + WARPS * p, s = 8 * (tau % GROUPS) + (lane & 7), u = 4 * (tau / GROUPS) + (lane >> 3);
            src[p] = s < n ? row(s) + u * 8 : nullptr;
            dst[p] = wg_unit(s, u);
        }
    }

    __device__ __forceinline__ void issue(unsigned char* xb, int first) const {   // first: the chunk's first value
#pragma unroll
        for (int p = 0; p < P; ++p)
            if (src[p])
#pragma unroll
                for (int q = 0; q < Q; ++q)
                    cp_async16(xb + dst[p] + q * (DU / 2) * XS_STEP, src[p] + first + q * DU * 8);
    }
};

template <int M>
__device__ __forceinline__ void pin_all(float (*acc)[NT][4]) {
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                pin(acc[m][nt][e]);
}

// acc[m] += 8 * (one block of matrix w[m], this warp's rows g, g + 8 at byte offsets og, o8) against the chunk whose
// step 0 tile desc0 describes, for m < M: the block's 8 runs (sub-block half h, run r: q = 4 h + r) in one unrolled
// sequence, both halves' records loaded first (one half after the other with a wait between: no faster, BENCHMARKS.md,
// the forty-ninth session)
template <int M>
__device__ __forceinline__ void block_product_wg(float (*acc)[NT][4], const unsigned char* const* w, long long og,
                                                 long long o8, unsigned long long desc0, const TabRow* tab, int t) {
    float dg[M], d8[M];
#pragma unroll
    for (int m = 0; m < M; ++m) {
        dg[m] = f16_to_f32(__ldg((const u16*)(w[m] + og)));
        d8[m] = f16_to_f32(__ldg((const u16*)(w[m] + o8)));
    }
    u32 ag[2][M], bg[2][M], a8[2][M], b8[2][M], sg[2][M], s8[2][M];
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int m = 0; m < M; ++m) {
            iq2_record(w[m], og, t + 4 * h, ag[h][m], bg[h][m]);
            iq2_record(w[m], o8, t + 4 * h, a8[h][m], b8[h][m]);
            sg[h][m] = run_scale(bg[h][m], dg[m]);
            s8[h][m] = run_scale(b8[h][m], d8[m]);
        }
    u32 v[8][M][2][4];                                          // run q: matrix m, row g / g + 8, value pairs
#pragma unroll
    for (int q = 0; q < 8; ++q) {
        const int h = q >> 2, r = q & 3;
#pragma unroll
        for (int m = 0; m < M; ++m) {
            iq2_run(tab, ag[h][m], bg[h][m], sg[h][m], r, v[q][m][0]);
            iq2_run(tab, a8[h][m], b8[h][m], s8[h][m], r, v[q][m][1]);
#pragma unroll
            for (int i = 0; i < 8; ++i)
                pin(v[q][m][i >> 2][i & 3]);
        }
        pin_all<M>(acc);
        wgmma_fence();
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const unsigned long long desc = desc0 + (unsigned long long)(((8 * h + 2 * r + half) * XS_STEP) >> 4);
#pragma unroll
            for (int m = 0; m < M; ++m)
                wgmma<NT>(acc[m], v[q][m][0][2 * half], v[q][m][1][2 * half], v[q][m][0][2 * half + 1],
                          v[q][m][1][2 * half + 1], desc);
        }
        wgmma_commit();
        if (q > 0) {                                            // run q - 1's products done: its registers free
            wgmma_wait<1>();
#pragma unroll
            for (int m = 0; m < M; ++m)
#pragma unroll
                for (int i = 0; i < 8; ++i)
                    pin(v[q - 1][m][i >> 2][i & 3]);
        }
    }
    wgmma_wait<0>();
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
        for (int i = 0; i < 8; ++i)
            pin(v[7][m][i >> 2][i & 3]);
    pin_all<M>(acc);
}

extern "C" __global__ void __launch_bounds__(WARPS * 32, MINB)
moe_gateup_iq2_wg(const u16* __restrict__ xh, const float* __restrict__ xscale, const long long* __restrict__ ids,
                  const float* __restrict__ wts, const int* __restrict__ order, const int* __restrict__ cnt,
                  const int* __restrict__ starts, const unsigned char* __restrict__ gate,
                  const unsigned char* __restrict__ up, const TabRow* __restrict__ tables, float* __restrict__ h,
                  int n_slots, int F, int D, float clamp) {
    // as moe_gateup_iq2's, xh in x_f16's wgmma order
    pdl_enter();
    extern __shared__ __align__(16) unsigned char smem[];
    unsigned char* xs = smem;                                   // [2][XS_CHUNK]: two chunks of x
    TabRow* tab = (TabRow*)(smem + 2 * XS_CHUNK);              // [384]
    long long* tokrow = (long long*)(smem + 2 * XS_CHUNK + TAB_BYTES);   // [CAP] each slot's token row in xh
    float* sslot = (float*)(tokrow + CAP);                      // [CAP] each slot's s / 8
    float* wslot = sslot + CAP;                                 // [CAP]
    int* pslot = (int*)(wslot + CAP);                           // [CAP]

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int item = starts[blockIdx.x], n = cnt[item], nsb = D / 256;
    if (n < 1)
        return;
    const long long row_bytes = (long long)nsb * IQ2_BYTES;
    const long long e = ids[order[item]];
    const int row0 = blockIdx.y * ROWS + warp * 16;             // this warp's 16 rows (its warpgroup's 64: warp / 4)
    const long long og = (e * F + row0 + g) * row_bytes, o8 = og + 8 * row_bytes;

    for (int i = tid; i < 384; i += WARPS * 32)
        tab[i] = __ldg(tables + i);
    for (int s = tid; s < CAP; s += WARPS * 32) {
        const int pair = s < n ? order[item + s] : 0;
        pslot[s] = pair;
        wslot[s] = s < n ? wts[pair] : 0.f;
        sslot[s] = s < n ? xscale[pair / n_slots] * 0.125f : 0.f;
        tokrow[s] = s < n ? (long long)(pair / n_slots) * D : 0;
    }
    for (int i = tid; i < 2 * CAP * 32; i += WARPS * 32) {     // slots past the item's pairs: zeros
        const int s = (i >> 5) % CAP;
        if (s >= n)
            *(uint4*)(xs + (i >= CAP * 32) * XS_CHUNK + wg_unit(s, i & 31)) = uint4{0u, 0u, 0u, 0u};
    }
    __syncthreads();

    const TileCopies copies(tid, n, [&](int s) { return xh + tokrow[s]; });
    auto stage = [&](int blk) {                                 // chunk blk of the item's tokens into buffer blk & 1
        copies.issue(xs + (blk & 1) * XS_CHUNK, blk * 256);
        cp_async_commit();
    };

    float acc[2][NT][4];                                        // gate, up
    zero(acc[0]);
    zero(acc[1]);
    const unsigned char* const mats[2] = {gate, up};
    pipelined_blocks<true>(nsb, stage, [&](int blk) {
        const unsigned char* xb = xs + (blk & 1) * XS_CHUNK;
        const unsigned long long desc0 = smem_desc(xb, 128, 256);
        const long long bg = og + blk * IQ2_BYTES, b8 = o8 + blk * IQ2_BYTES;
#if FUSE
        block_product_wg<2>(acc, mats, bg, b8, desc0, tab, t);
#else
        block_product_wg<1>(acc, mats, bg, b8, desc0, tab, t);
        block_product_wg<1>(acc + 1, mats + 1, bg, b8, desc0, tab, t);
#endif
    });
    for_each_output(n, g, t, [&](int s, int r, int nt, int e4) {
        const float gv = fminf(acc[0][nt][e4] * sslot[s], clamp);
        const float uv = fminf(fmaxf(acc[1][nt][e4] * sslot[s], -clamp), clamp);
        h[(long long)pslot[s] * F + row0 + r] = wslot[s] * (gv / (1.f + expf(-gv))) * uv;
    });
}
#endif

// ---------------------------------------------------------------------------------------------------------------------
// The Q2_K down product of the same items: y[pair, rows] = down_e h[pair], h as split_runs stores it (a row per pair:
// hi parts, the 16-value run sums' hi and lo parts, inv).
//
// Q2_K block (84 bytes): scales[16] (run c = values 16c..16c+15: sc = low nibble, m = high nibble) | qs[64] | f16 d |
// f16 dmin; value 128n + 32j + l (l < 32) = d * sc * q - dmin * m with q = (qs[32n + l] >> 2j) & 3. A qs word (n, w)
// (bytes 32n + 4w..) holds, for each j, 4 consecutive values of run 8n + 2j + (w >= 4). The block's k step (n, j, hw)
// is run 8n + 2j + hw: lane t takes word (n, t + 4hw)'s 4 values of it (sc * q, exact float16 integers <= 45), rows g
// and g + 8. The min term is one more product per block: m of the 16 runs (exact) against the run sums (hi + lo: it can
// be large beside the result it is subtracted from), applied with dmin.

#define Q2K_BYTES 84
#define Q2K_SLOT 96                           // stage_rows' bytes a row (wgmma): 6 units (84 bytes from 0..12 past one)

// where 8-byte unit u of a chunk (values 4u..4u+3: word w = u % 8 of (n, j) = (u / 32, u / 8 % 4)) goes in shared
// memory: lane t's units of step (n, j, hw = 0, 1) are 32n + 8j + 2t + hw, one 16-byte read
__device__ __forceinline__ int x8_unit(int u) {
    const int w = u & 7;
    return (u & ~7) + 2 * (w & 3) + (w >> 2);
}

// w[i] for a run-time i < 4 by selects (indexing a register array at run time would put it in local memory)
__device__ __forceinline__ u32 pick(const u32 (&w)[4], int i) {
    return i == 0 ? w[0] : i == 1 ? w[1] : i == 2 ? w[2] : w[3];
}

// the two bytes of w that sel picks (0x4140: bytes 0, 1; 0x4342: bytes 2, 3) as an exact float16 pair
__device__ __forceinline__ u32 byte_pair_f16(u32 w, u32 sel) {
    return sub_f16x2(prmt(w, 0x64646464u, sel), 0x64006400u);
}

// the min term's A fragment (m of runs 2t, 2t + 1: a0 row g, a1 row g + 8; runs 2t + 8, 2t + 9: a2, a3) from the 16
// scale bytes of rows g (scg) and g + 8 (sc8)
__device__ __forceinline__ void q2k_min_fragment(const u32 (&scg)[4], const u32 (&sc8)[4], int t, u32 (&a)[4]) {
    const u32 sel = (t & 1) ? 0x4342u : 0x4140u;
    a[0] = byte_pair_f16((pick(scg, t >> 1) >> 4) & 0x0f0f0f0fu, sel);
    a[1] = byte_pair_f16((pick(sc8, t >> 1) >> 4) & 0x0f0f0f0fu, sel);
    a[2] = byte_pair_f16((pick(scg, (t >> 1) + 2) >> 4) & 0x0f0f0f0fu, sel);
    a[3] = byte_pair_f16((pick(sc8, (t >> 1) + 2) >> 4) & 0x0f0f0f0fu, sel);
}

// the main term's A fragment of k step (half, j, hw): sc * q of qs words qg (row g), q8 (row g + 8) at shift j, sg /
// s8 the scale nibbles of their runs (8 half + 4 (j / 2) ..)
__device__ __forceinline__ void q2k_fragment(u32 qg, u32 q8, u32 sg, u32 s8, int j, int hw, u32 (&a)[4]) {
    const u32 b = 2 * (j & 1) + hw;                             // the run's byte in its scale word
    const u32 sel = 0x4040u | b | (b << 8);
    const u32 scale_g = byte_pair_f16(sg, sel), scale_8 = byte_pair_f16(s8, sel);
    const u32 wg = (qg >> (2 * j)) & 0x03030303u, w8 = (q8 >> (2 * j)) & 0x03030303u;
    a[0] = mul_f16x2(byte_pair_f16(wg, 0x4140u), scale_g);
    a[1] = mul_f16x2(byte_pair_f16(w8, 0x4140u), scale_8);
    a[2] = mul_f16x2(byte_pair_f16(wg, 0x4342u), scale_g);
    a[3] = mul_f16x2(byte_pair_f16(w8, 0x4342u), scale_8);
}

extern "C" __global__ void __launch_bounds__(WARPS * 32, MINB)
moe_down_q2k(const u16* __restrict__ hh, const u16* __restrict__ hsh, const u16* __restrict__ hsl,
             const float* __restrict__ hinv, const long long* __restrict__ ids, const int* __restrict__ order,
             const int* __restrict__ cnt, const int* __restrict__ starts, const unsigned char* __restrict__ down,
             float* __restrict__ y, int D, int F) {
    // hh [P, F] float16 bits, hsh / hsl [P, F / 16] float16 bits, hinv [P, F / 256]: split_runs of h; down [E, D,
    // F / 256 * 84] Q2_K; y [P, D] float32
    pdl_enter();
    extern __shared__ __align__(16) unsigned char smem[];
    unsigned char* xs = smem;                                   // [2][CAP][XSTRIDE]: two chunks of h
    unsigned char* ss = smem + 2 * CAP * XSTRIDE;               // [2][CAP][64]: their run sums, hi then lo
    long long* prow = (long long*)(ss + 2 * CAP * 64);          // [CAP] each slot's pair
    float* inv = (float*)(prow + CAP);                          // [2][CAP]

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int item = starts[blockIdx.x], n = cnt[item], nsb = F / 256;
    if (n < 1)                                                  // past the list's items
        return;
    const long long row_bytes = (long long)nsb * Q2K_BYTES;
    const long long e = ids[order[item]];
    const int row0 = blockIdx.y * ROWS + warp * 16;
    const long long og = (e * D + row0 + g) * row_bytes, o8 = og + 8 * row_bytes;

    for (int s = tid; s < CAP; s += WARPS * 32)
        prow[s] = s < n ? (long long)order[item + s] : 0;
    zero_dead_slots(xs, XSTRIDE, 32, n, tid);
    zero_dead_slots(ss, 64, 4, n, tid);
    __syncthreads();

    auto stage = [&](int blk) {
        unsigned char* xb = xs + (blk & 1) * CAP * XSTRIDE;
        unsigned char* sb = ss + (blk & 1) * CAP * 64;
        for (int i = tid; i < n * 68; i += WARPS * 32) {
            const int s = i / 68, u = i % 68;
            if (u < 64)
                cp_async8(xb + s * XSTRIDE + x8_unit(u) * 8, hh + prow[s] * F + blk * 256 + u * 4);
            else
                cp_async16(sb + s * 64 + (u - 64) * 16, ((u - 64) < 2 ? hsh : hsl) + prow[s] * (F / 16) + blk * 16 +
                                                            ((u - 64) & 1) * 8);
        }
        cp_async_commit();
        for (int s = tid; s < CAP; s += WARPS * 32)
            inv[(blk & 1) * CAP + s] = s < n ? hinv[prow[s] * nsb + blk] : 0.f;
    };

    float acc[NT][4];
    zero(acc);
    pipelined_blocks(nsb, stage, [&](int blk) {
        const unsigned char* xb = xs + (blk & 1) * CAP * XSTRIDE;
        const unsigned char* sb = ss + (blk & 1) * CAP * 64;
        const float* ib = inv + (blk & 1) * CAP;
        const long long bg = og + (long long)blk * Q2K_BYTES, b8 = o8 + (long long)blk * Q2K_BYTES;
        u32 scg[4], sc8[4];                                     // the 16 scale bytes of rows g, g + 8
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            scg[i] = __ldg((const u32*)(down + bg) + i);
            sc8[i] = __ldg((const u32*)(down + b8) + i);
        }
        const u32 ddg = __ldg((const u32*)(down + bg + 80)), dd8 = __ldg((const u32*)(down + b8 + 80));
        float c[NT][4];
        // the min term: m of runs 2t, 2t + 1 (a0 / a1) and 2t + 8, 2t + 9 (a2 / a3) against the run sums
        {
            u32 m[4];
            q2k_min_fragment(scg, sc8, t, m);
            zero(c);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const u32* sums = (const u32*)(sb + (8 * nt + g) * 64);
                mma(c[nt], m[0], m[1], m[2], m[3], sums[t], sums[t + 4]);           // hi parts
                mma(c[nt], m[0], m[1], m[2], m[3], sums[8 + t], sums[12 + t]);      // lo parts
            }
            add_scaled(acc, c, -f16_to_f32((u16)(ddg >> 16)), -f16_to_f32((u16)(dd8 >> 16)), ib, t);   // - dmin
            zero(c);
        }
        // the main term: steps (n, j, hw)
#pragma unroll 1
        for (int half = 0; half < 2; ++half) {
            u32 qg[2], q8[2];                                   // qs words (half, t + 4hw) of rows g, g + 8
#pragma unroll
            for (int hw = 0; hw < 2; ++hw) {
                qg[hw] = __ldg((const u32*)(down + bg + 16 + 32 * half + 4 * (t + 4 * hw)));
                q8[hw] = __ldg((const u32*)(down + b8 + 16 + 32 * half + 4 * (t + 4 * hw)));
            }
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const u32 sg = (half ? scg[2 + (j >> 1)] : scg[j >> 1]) & 0x0f0f0f0fu;     // scale bytes of runs
                const u32 s8 = (half ? sc8[2 + (j >> 1)] : sc8[j >> 1]) & 0x0f0f0f0fu;     // 8 half + 4 (j / 2) ..
                uint4 xv[NT];
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
                    xv[nt] = *(const uint4*)(xb + (8 * nt + g) * XSTRIDE + (256 * half + 64 * j + 16 * t));
#pragma unroll
                for (int hw = 0; hw < 2; ++hw) {
                    u32 a[4];
                    q2k_fragment(qg[hw], q8[hw], sg, s8, j, hw, a);
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt)
                        mma(c[nt], a[0], a[1], a[2], a[3], hw ? xv[nt].z : xv[nt].x, hw ? xv[nt].w : xv[nt].y);
                }
            }
        }
        add_scaled(acc, c, f16_to_f32((u16)ddg), f16_to_f32((u16)dd8), ib, t);
    });
    for_each_output(n, g, t, [&](int s, int r, int nt, int e4) { y[prow[s] * D + row0 + r] = acc[nt][e4]; });
}

#if WG
// ---------------------------------------------------------------------------------------------------------------------
// moe_down_q2k_wg: the down on wgmma (sm_90a; built with WG=1). Here the tensor cores get each value whole, as the
// gate/up's: float16 (q * float16(d sc) - float16(dmin m)) (one packed FMA per two values after the run's two packed
// products), against h as q8_triton.x_f16's rows (float16 of h / s, s a power of two per pair), so the accumulators
// run over all blocks: no min-term products, no per-block partial sums to scale (moe_down_q2k's scheme took two
// drains of the tensor cores a block and twice the accumulators). s is applied at the end. Each value is rounded
// three times (d sc, dmin m, the FMA: ~2^-11 of the larger term each), as the gate/up's twice: ~5e-4 normwise.
// A the per-warp float16 fragments of moe_down_q2k's k steps (run 8 n + 2 j + hw of the block: lane t's 4 values of
// qs word (n, t + 4 hw) at shift 2 j, rows g and g + 8), B tiles in shared memory read by the tensor cores (the layout
// of moe_gateup_iq2_wg: core matrices of 8 tokens x 16 bytes, token group after K half).
//
// h comes in x_f16's down order (q8_triton.x_f16(..., down_order=True), q8_triton.down_wgmma_position): in each
// 256-value chunk, position 16 ks + 8 kc + 2 t + b holds value 128 n + 32 j + 4 (t + 4 hw) + 2 kc + b, k step ks =
// 8 n + 2 j + hw: the K half kc of lane t's 4 values of step (n, j, hw) above.

// The down's weights of a k block in shared memory, copied with h's chunk by the same cp.async group (stage), so that
// the products read no global memory: the program's row r (the thread's: r = tid % ROWS, its block at global offset
// start, 4-byte aligned) in slot r of Q2K_SLOT bytes, the 16-byte units from the 16-byte floor of the block's first
// byte on, the last one copying only the block's bytes (no read past the tensor): the block starts at its slot +
// (start & 15). Each thread copies PER units of its row's slot. H100, ncu: the down's stalls on global loads 22 -> 13 %
// of its samples, 1.97 -> 1.83 ms at 2048 tokens; the gate/up staged the same way ran slower (2.24 -> 2.32 ms: more
// shared-memory reads, the same stalls moved to the barrier), so it reads its records from global memory
// (BENCHMARKS.md, the fiftieth session).
__device__ __forceinline__ void stage_rows(unsigned char* wb, const unsigned char* w, long long start, int tid) {
    constexpr int UNITS = Q2K_SLOT / 16, PER = ROWS * UNITS / (WARPS * 32);
    static_assert(PER * WARPS * 32 == ROWS * UNITS && UNITS % PER == 0, "stage_rows: whole slots' units a thread");
    const int u0 = tid / ROWS * PER;
    const long long base = start & ~15LL;
#pragma unroll
    for (int u = u0; u < u0 + PER; ++u)
        cp_async16_n(wb + (tid % ROWS) * Q2K_SLOT + 16 * u, w + base + 16 * u,
                     min(16, (int)(start + Q2K_BYTES - base) - 16 * u));
}

// the A fragment of k step (n, j, hw) with the run's scale and min in the values, of qs words qg (row g), q8 (row
// g + 8) at shift j and the run's scale byte in sg / s8 (byte 2 (j % 2) + hw), each row's d and -dmin as packed pairs
// (dg, mg; d8, m8): float16((sc q) d + hi) + lo, where sc q is exact, the FMA rounds once, and hi + lo = -dmin m
// exactly (m dmin has at most 15 significant bits: hi its float16 rounding, lo the rest, exact by a second FMA), so
// each value is off by two roundings of itself (~2^-11), not of its terms (which cancel where q m dmin ~ d sc q)
__device__ __forceinline__ void q2k_value_pair(u32 wq, u32 sc, u32 d, u32 hi, u32 lo, u32& a0, u32& a2) {
    a0 = add_f16x2(fma_f16x2(mul_f16x2(byte_pair_f16(wq, 0x4140u), sc), d, hi), lo);
    a2 = add_f16x2(fma_f16x2(mul_f16x2(byte_pair_f16(wq, 0x4342u), sc), d, hi), lo);
}

__device__ __forceinline__ void q2k_value_fragment(u32 qg, u32 q8, u32 sg, u32 s8, u32 dg, u32 mg, u32 d8, u32 m8,
                                                   int j, int hw, u32 (&a)[4]) {
    const u32 b = 2 * (j & 1) + hw;
    const u32 sel = 0x4040u | b | (b << 8);                     // the run's byte, twice
    const u32 mm_g = byte_pair_f16((sg >> 4) & 0x0f0f0f0fu, sel), mm_8 = byte_pair_f16((s8 >> 4) & 0x0f0f0f0fu, sel);
    const u32 hi_g = mul_f16x2(mm_g, mg), hi_8 = mul_f16x2(mm_8, m8);
    const u32 lo_g = fma_f16x2(mm_g, mg, hi_g ^ 0x80008000u), lo_8 = fma_f16x2(mm_8, m8, hi_8 ^ 0x80008000u);
    q2k_value_pair((qg >> (2 * j)) & 0x03030303u, byte_pair_f16(sg & 0x0f0f0f0fu, sel), dg, hi_g, lo_g, a[0], a[2]);
    q2k_value_pair((q8 >> (2 * j)) & 0x03030303u, byte_pair_f16(s8 & 0x0f0f0f0fu, sel), d8, hi_8, lo_8, a[1], a[3]);
}

extern "C" __global__ void __launch_bounds__(WARPS * 32, MINB)
moe_down_q2k_wg(const u16* __restrict__ hh, const float* __restrict__ hscale, const long long* __restrict__ ids,
                const int* __restrict__ order, const int* __restrict__ cnt, const int* __restrict__ starts,
                const unsigned char* __restrict__ down, float* __restrict__ y, int D, int F) {
    // hh float16 [P, F] (x_f16's rows of h, down order), hscale float32 [P] their s; ids int64 [P] pair -> expert;
    // down [E, D, F / 256 * 84] Q2_K; y [P, D] float32
    pdl_enter();
    extern __shared__ __align__(16) unsigned char smem[];
    unsigned char* xs = smem;                                   // [2][XS_CHUNK]: two chunks of h
    unsigned char* ws = xs + 2 * XS_CHUNK;                      // [2][ROWS * Q2K_SLOT]: their blocks of the rows
    long long* prow = (long long*)(ws + 2 * ROWS * Q2K_SLOT);   // [CAP] each slot's pair
    float* sslot = (float*)(prow + CAP);                        // [CAP] each slot's s

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int item = starts[blockIdx.x], n = cnt[item], nsb = F / 256;
    if (n < 1)                                                  // past the list's items
        return;
    const long long row_bytes = (long long)nsb * Q2K_BYTES;
    const long long e = ids[order[item]];
    const int row0 = blockIdx.y * ROWS + warp * 16;
    const long long og = (e * D + row0 + g) * row_bytes, o8 = og + 8 * row_bytes;
    const long long ostage = (e * D + blockIdx.y * ROWS + tid % ROWS) * row_bytes;      // the row this thread stages

    for (int s = tid; s < CAP; s += WARPS * 32) {
        prow[s] = s < n ? (long long)order[item + s] : 0;
        sslot[s] = s < n ? hscale[order[item + s]] : 0.f;
    }
    for (int i = tid; i < 2 * CAP * 32; i += WARPS * 32) {     // slots past the item's pairs: zeros
        const int s = (i >> 5) % CAP;
        if (s >= n)
            *(uint4*)(xs + (i >= CAP * 32) * XS_CHUNK + wg_unit(s, i & 31)) = uint4{0u, 0u, 0u, 0u};
    }
    __syncthreads();

    const TileCopies copies(tid, n, [&](int s) { return hh + prow[s] * F; });
    auto stage = [&](int blk) {
        copies.issue(xs + (blk & 1) * XS_CHUNK, blk * 256);
        stage_rows(ws + (blk & 1) * ROWS * Q2K_SLOT, down, ostage + blk * Q2K_BYTES, tid);
        cp_async_commit();
    };

    float acc[NT][4];
    zero(acc);
    pipelined_blocks<true>(nsb, stage, [&](int blk) {
        const unsigned long long desc_h = smem_desc(xs + (blk & 1) * XS_CHUNK, 128, 256);
        const unsigned char* wb = ws + (blk & 1) * ROWS * Q2K_SLOT + (warp * 16 + g) * Q2K_SLOT;
        const u32* wg = (const u32*)(wb + ((og + blk * Q2K_BYTES) & 15));               // row g's block, staged
        const u32* w8 = (const u32*)(wb + 8 * Q2K_SLOT + ((o8 + blk * Q2K_BYTES) & 15));   // row g + 8's
        u32 scg[4], sc8[4];                                     // the 16 scale bytes of rows g, g + 8
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            scg[i] = wg[i];
            sc8[i] = w8[i];
        }
        const u32 ddg = wg[20], dd8 = w8[20];                   // (d, dmin) of each row
        const u32 dg = prmt(ddg, 0u, 0x1010u), d8 = prmt(dd8, 0u, 0x1010u);                   // (d, d)
        const u32 mg = prmt(ddg, 0u, 0x3232u) ^ 0x80008000u, m8 = prmt(dd8, 0u, 0x3232u) ^ 0x80008000u;  // -dmin
        u32 a[16][4];                                           // k step q = 8 half + 2 j + hw
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            u32 qg[2], q8[2];                                   // qs words (half, t + 4hw) of rows g, g + 8
#pragma unroll
            for (int hw = 0; hw < 2; ++hw) {
                qg[hw] = wg[4 + 8 * half + t + 4 * hw];
                q8[hw] = w8[4 + 8 * half + t + 4 * hw];
            }
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const u32 sg = half ? scg[2 + (j >> 1)] : scg[j >> 1];
                const u32 s8 = half ? sc8[2 + (j >> 1)] : sc8[j >> 1];
#pragma unroll
                for (int hw = 0; hw < 2; ++hw) {
                    const int q = 8 * half + 2 * j + hw;
                    q2k_value_fragment(qg[hw], q8[hw], sg, s8, dg, mg, d8, m8, j, hw, a[q]);
#pragma unroll
                    for (int i = 0; i < 4; ++i)
                        pin(a[q][i]);
                    pin_all<1>(&acc);
                    wgmma_fence();
                    wgmma<NT>(acc, a[q][0], a[q][1], a[q][2], a[q][3],
                              desc_h + (unsigned long long)((q * XS_STEP) >> 4));
                    wgmma_commit();
                    if (q > 0) {                                // step q - 1's products done: its A registers free
                        wgmma_wait<1>();
#pragma unroll
                        for (int i = 0; i < 4; ++i)
                            pin(a[q - 1][i]);
                    }
                }
            }
        }
        wgmma_wait<0>();                                        // before the barrier that lets the buffer be reused
#pragma unroll
        for (int i = 0; i < 4; ++i)
            pin(a[15][i]);
        pin_all<1>(&acc);
    });
    for_each_output(n, g, t,
                    [&](int s, int r, int nt, int e4) { y[prow[s] * D + row0 + r] = acc[nt][e4] * sslot[s]; });
}
#endif

