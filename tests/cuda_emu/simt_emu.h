// A CPU stand-in for the GPU, for tests: runs this project's CUDA C++ kernels (plugins/kernels/*.cu) compiled by g++
// as host code, each CUDA thread a fiber (ucontext), the programs one after another. tests/cuda_emu.py builds a
// kernel with this header and launch.cpp into a shared library and calls it on tensors in host memory.
//
// What it models: threadIdx / blockIdx / blockDim / gridDim; __syncthreads (all threads of the program); warp
// collectives (__shfl_xor_sync and the tensor-core mma) as exchanges among the 32 lanes of a warp; the dynamic
// shared memory of a program (`extern __shared__ ... smem[]`, filled with 0xff bytes, a float NaN, before each
// program so that reading what no thread wrote shows), and the PTX helpers of ptx_ops.cuh, defined here from the PTX
// ISA's descriptions:
//   prmt.b32 (default mode)      bytes {b, a} indexed by the selector's nibbles, bit 3 replicating the sign bit
//   add / sub / mul / fma.rn.f16x2, cvt.rn.f16.f32   exact result rounded once to float16, to nearest even
//                                  (overflow to infinity); cp.async: the copy made at the wait for its group
//   mma.m16n8k16.row.col f32.f16   the fragment layouts of PTX ISA 9.7.14.5.8 (groupID = lane >> 2, t = lane % 4):
//                                  A a_i row g (+8 for i = 2, 3, 6, 7), col 2t + (i & 1) (+8 for i >= 4);
//                                  B b_i row 2t + (i & 1) (+8 for i >= 2), col g; C / D c_i row g (+8 for i >= 2),
//                                  col 2t + (i & 1). The 16 products and C summed in double, rounded to float once
//                                  (the tensor cores' own rounding differs by a few float32 ulps).
// Reads through __ldg, __ldcg and cp.async are checked against the launch's tensor arguments (a read outside all of
// them fails the launch; plain dereferences are not checked).
// Not modelled: timing, memory ordering (programs run in sequence; atomics and fences are plain), static __shared__
// arrays (only dynamic shared memory is shared), divergent collectives (a collective a lane skips deadlocks: the
// launch then fails with an error instead of hanging).
#pragma once
#define DS4_PTX_OPS_CUH                       // ptx_ops.cuh is replaced by the definitions below

#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

typedef unsigned int u32;
typedef unsigned short u16;

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __align__(n) __attribute__((aligned(n)))
#define __shared__

struct __attribute__((aligned(16))) uint4 { u32 x, y, z, w; };
struct __attribute__((aligned(16))) float4 { float x, y, z, w; };
struct emu_dim3 { unsigned x = 0, y = 0, z = 0; };

namespace emu {

constexpr int kMaxThreads = 1024, kSmemBytes = 232448, kSlotBytes = 64, kStackBytes = 256 * 1024;

struct Barrier {
    int need = 0, arrived = 0;
    unsigned generation = 0;
};

struct Copy {
    void* dst;
    const void* src;
    int bytes;
};

struct Fiber {
    ucontext_t ctx;
    std::vector<char> stack;
    emu_dim3 tid;
    bool done = false;
    std::vector<std::vector<Copy>> groups;    // committed cp.async groups not yet waited for, oldest first
    std::vector<Copy> open;                   // copies issued since the last commit
};

inline ucontext_t scheduler;
inline std::vector<Fiber> fibers;
inline Fiber* current = nullptr;
inline std::function<void()> body;
inline emu_dim3 block_idx, block_dim, grid_dim;
inline Barrier block_barrier;
inline std::vector<Barrier> warp_barriers;
inline unsigned char slots[kMaxThreads][kSlotBytes];     // a lane's contribution to its warp's collective
inline unsigned long long events = 0;                    // arrivals and finished threads: progress
inline std::vector<std::pair<const char*, const char*>> buffers;   // the launch's tensors: [begin, end) of each
inline std::string fault;                                 // the first read outside them (__ldg, __ldcg, cp.async)

// whether [p, p + bytes) lies in one of the launch's tensors; if not, the first such read is reported by launch
inline bool readable(const void* p, int bytes) {
    const char* c = (const char*)p;
    for (const auto& [begin, end] : buffers)
        if (c >= begin && c + bytes <= end)
            return true;
    if (fault.empty())
        fault = "emu: a read of " + std::to_string(bytes) + " bytes outside every tensor argument";
    return false;
}

inline int thread_index() { return (int)(current - fibers.data()); }

inline void yield() { swapcontext(&current->ctx, &scheduler); }

inline void arrive(Barrier& b) {
    ++events;
    const unsigned gen = b.generation;
    if (++b.arrived == b.need) {
        b.arrived = 0;
        ++b.generation;
        return;
    }
    while (b.generation == gen)
        yield();
}

inline Barrier& warp_barrier() { return warp_barriers[thread_index() / 32]; }

// each lane posts `bytes` of its own, then reads any lane's of the same warp through f(lane) -> pointer
template <typename F>
inline void exchange(const void* mine, int bytes, F&& use) {
    std::memcpy(slots[thread_index()], mine, bytes);
    arrive(warp_barrier());
    const int base = thread_index() & ~31;
    use([base](int lane) -> const unsigned char* { return slots[base + lane]; });
    arrive(warp_barrier());
}

inline void trampoline() {
    body();
    current->done = true;
    ++events;
}

// Runs body on grid x block threads; returns "" or why it could not (a deadlock: threads waiting at different
// collectives or barriers).
inline std::string launch(emu_dim3 grid, emu_dim3 block, unsigned smem_bytes, std::function<void()> kernel,
                          unsigned char* smem) {
    const int threads = (int)(block.x * block.y * block.z);
    if (threads < 1 || threads > kMaxThreads || threads % 32 || smem_bytes > (unsigned)kSmemBytes)
        return "emu: unsupported launch (threads a multiple of 32 up to 1024, shared memory up to 227 KiB)";
    body = std::move(kernel);
    fault.clear();
    grid_dim = grid, block_dim = block;
    fibers.resize(threads);
    warp_barriers.assign(threads / 32, Barrier{32});
    for (unsigned bz = 0; bz < grid.z; ++bz)
        for (unsigned by = 0; by < grid.y; ++by)
            for (unsigned bx = 0; bx < grid.x; ++bx) {
                block_idx = {bx, by, bz};
                block_barrier = Barrier{threads};
                for (auto& b : warp_barriers)
                    b = Barrier{32};
                std::memset(smem, 0xff, kSmemBytes);
                for (int i = 0; i < threads; ++i) {
                    Fiber& f = fibers[i];
                    f.stack.resize(kStackBytes);
                    f.done = false;
                    f.groups.clear();
                    f.open.clear();
                    f.tid = {(unsigned)i % block.x, (unsigned)i / block.x % block.y,
                             (unsigned)i / (block.x * block.y)};
                    getcontext(&f.ctx);
                    f.ctx.uc_stack.ss_sp = f.stack.data();
                    f.ctx.uc_stack.ss_size = f.stack.size();
                    f.ctx.uc_link = &scheduler;
                    makecontext(&f.ctx, trampoline, 0);
                }
                for (int live = threads; live > 0;) {
                    const unsigned long long before = events;
                    live = 0;
                    for (auto& f : fibers)
                        if (!f.done) {
                            current = &f;
                            swapcontext(&scheduler, &f.ctx);
                            live += !f.done;
                        }
                    if (live && events == before)
                        return "emu: deadlock in program (" + std::to_string(bx) + ", " + std::to_string(by) +
                               "): threads wait at different barriers or collectives";
                }
            }
    current = nullptr;
    return fault;
}

// float16 <-> double, exactly as IEEE binary16 (round to nearest even, overflow to infinity)
inline double f16_value(u16 h) {
    const int e = (h >> 10) & 31, m = h & 1023;
    const double v = e == 0 ? std::ldexp((double)m, -24)
                     : e == 31 ? (m ? NAN : INFINITY)
                               : std::ldexp((double)(1024 + m), e - 25);
    return (h & 0x8000) ? -v : v;
}

inline u16 f16_bits(double v) {
    const u16 sign = std::signbit(v) ? 0x8000 : 0;
    if (std::isnan(v))
        return sign | 0x7e00;
    const double a = std::fabs(v);
    if (a >= 65520.0)                         // halfway between 65504 and 65536 and beyond: infinity
        return sign | 0x7c00;
    if (a < std::ldexp(1.0, -14))             // subnormal (or rounds up to the smallest normal, 1024 = 0x0400)
        return sign | (u16)std::nearbyint(std::ldexp(a, 24));
    int e;
    std::frexp(a, &e);                        // a in [2^(e-1), 2^e)
    double m = std::nearbyint(std::ldexp(a, 11 - e));   // in [1024, 2048]
    if (m == 2048.0)
        m = 1024.0, ++e;
    return sign | (u16)(((e + 14) << 10) | ((int)m - 1024));
}

}  // namespace emu

#define threadIdx (emu::current->tid)
#define blockIdx (emu::block_idx)
#define blockDim (emu::block_dim)
#define gridDim (emu::grid_dim)

inline void __syncthreads() { emu::arrive(emu::block_barrier); }
inline void __threadfence() {}
template <typename T> inline T __ldg(const T* p) { return emu::readable(p, sizeof(T)) ? *p : T{}; }
template <typename T> inline T __ldcg(const T* p) { return emu::readable(p, sizeof(T)) ? *p : T{}; }
inline int atomicAdd(int* p, int v) { const int old = *p; *p += v; return old; }
inline int atomicExch(int* p, int v) { const int old = *p; *p = v; return old; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }

template <typename T>
inline T __shfl_xor_sync(unsigned, T v, int mask) {
    static_assert(sizeof(T) <= emu::kSlotBytes, "a lane's value must fit its slot");
    T got;
    emu::exchange(&v, sizeof(T),
                  [&](auto lane) { std::memcpy(&got, lane((emu::thread_index() & 31) ^ mask), sizeof(T)); });
    return got;
}

// ---- ptx_ops.cuh ----
inline u32 prmt(u32 a, u32 b, u32 sel) {
    const unsigned long long bytes = (unsigned long long)a | ((unsigned long long)b << 32);
    u32 d = 0;
    for (int i = 0; i < 4; ++i) {
        const u32 nib = (sel >> (4 * i)) & 15;
        u32 byte = (u32)(bytes >> (8 * (nib & 7))) & 0xff;
        if (nib & 8)
            byte = (byte & 0x80) ? 0xff : 0;
        d |= byte << (8 * i);
    }
    return d;
}

inline u32 sub_f16x2(u32 a, u32 b) {
    const u16 lo = emu::f16_bits(emu::f16_value((u16)a) - emu::f16_value((u16)b));
    const u16 hi = emu::f16_bits(emu::f16_value((u16)(a >> 16)) - emu::f16_value((u16)(b >> 16)));
    return lo | ((u32)hi << 16);
}

inline u32 mul_f16x2(u32 a, u32 b) {
    const u16 lo = emu::f16_bits(emu::f16_value((u16)a) * emu::f16_value((u16)b));
    const u16 hi = emu::f16_bits(emu::f16_value((u16)(a >> 16)) * emu::f16_value((u16)(b >> 16)));
    return lo | ((u32)hi << 16);
}

inline u32 add_f16x2(u32 a, u32 b) {
    const u16 lo = emu::f16_bits(emu::f16_value((u16)a) + emu::f16_value((u16)b));
    const u16 hi = emu::f16_bits(emu::f16_value((u16)(a >> 16)) + emu::f16_value((u16)(b >> 16)));
    return lo | ((u32)hi << 16);
}

inline u32 fma_f16x2(u32 a, u32 b, u32 c) {        // a * b + c in double (exact unless 2^30 apart), rounded once
    const u16 lo = emu::f16_bits(emu::f16_value((u16)a) * emu::f16_value((u16)b) + emu::f16_value((u16)c));
    const u16 hi = emu::f16_bits(emu::f16_value((u16)(a >> 16)) * emu::f16_value((u16)(b >> 16))
                                 + emu::f16_value((u16)(c >> 16)));
    return lo | ((u32)hi << 16);
}

// cp.async: a copy lands only when its thread waits for its group (the latest the hardware may take), so shared
// memory read before the wait and barrier still holds what was there (NaN bytes or an older block), and a copy never
// waited for never lands
inline void pdl_enter() {}                          // programmatic dependent launch: programs run one at a time here
inline uint4 ldg_before_wait(const uint4* p) { return __ldg(p); }
inline void cp_async16(void* shared_dst, const void* global_src) {
    if (emu::readable(global_src, 16))
        emu::current->open.push_back({shared_dst, global_src, 16});
}
inline void cp_async16_n(void* shared_dst, const void* global_src, int n) {   // n bytes of src, 16 - n zeros
    if (n > 0 && emu::readable(global_src, n))
        emu::current->open.push_back({shared_dst, global_src, n});
    static const char zeros[16] = {};
    if (n < 16)
        emu::current->open.push_back({(char*)shared_dst + n, zeros, 16 - n});
}
inline void cp_async8(void* shared_dst, const void* global_src) {
    if (emu::readable(global_src, 8))
        emu::current->open.push_back({shared_dst, global_src, 8});
}
inline void cp_async_commit() {
    emu::current->groups.push_back(std::move(emu::current->open));
    emu::current->open.clear();
}
template <int N> inline void cp_async_wait() {
    auto& groups = emu::current->groups;
    while ((int)groups.size() > N) {
        for (const emu::Copy& c : groups.front())
            std::memcpy(c.dst, c.src, c.bytes);
        groups.erase(groups.begin());
    }
}

inline u16 f32_to_f16(float f) { return emu::f16_bits(f); }
inline float f16_to_f32(u16 h) { return (float)emu::f16_value(h); }

inline void mma(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    struct Frag { u32 a[4], b[2]; };
    const Frag mine{{a0, a1, a2, a3}, {b0, b1}};
    const int lane = emu::thread_index() & 31, g = lane >> 2, t = lane & 3;
    float d[4];
    emu::exchange(&mine, sizeof mine, [&](auto frag) {
        // A[r][k]: lane 4 (r % 8) + (k % 8) / 2, register (r >= 8) + 2 (k >= 8), half k % 2; B[k][n]: lane 4n + (k %
        // 8) / 2, register k >= 8, half k % 2
        auto half = [](u32 w, int i) { return emu::f16_value((u16)(w >> (16 * i))); };
        for (int i = 0; i < 4; ++i) {
            const int r = g + 8 * (i >> 1), n = 2 * t + (i & 1);
            double s = c[i];
            for (int k = 0; k < 16; ++k) {
                const Frag* fa = (const Frag*)frag(4 * (r % 8) + (k % 8) / 2);
                const Frag* fb = (const Frag*)frag(4 * n + (k % 8) / 2);
                s += half(fa->a[(r >= 8) + 2 * (k >= 8)], k % 2) * half(fb->b[k >= 8], k % 2);
            }
            d[i] = (float)s;
        }
    });
    for (int i = 0; i < 4; ++i)
        c[i] = d[i];
}

#if WG
// wgmma (ptx_ops.cuh's WG part): D rows 16 w .. 16 w + 15 of warp w of the warpgroup take its A fragments (mma's
// layout, exchanged among the warp's lanes like mma) against B read from shared memory at the moment of the call
// through the descriptor: no-swizzle core matrices of 8 rows x 16 bytes, element (k, n) at start + (n / 8) * sbo
// + (n % 8) * 16 + (k / 8) * lbo + (k % 8) * 2 (PTX ISA's canonical K-major layout). Products summed in double,
// rounded to float once. fence / commit / wait / the proxy fence / pin are no-ops (a call's result is there at once).
extern unsigned char smem[];                  // launch.cpp's: the programs' dynamic shared memory
inline unsigned long long smem_desc(const void* p, u32 lbo, u32 sbo) {
    const unsigned long long a = (unsigned long long)((const unsigned char*)p - smem);
    return ((a & 0x3FFFF) >> 4) | (unsigned long long)(lbo >> 4) << 16 | (unsigned long long)(sbo >> 4) << 32;
}
inline void wgmma_fence() {}
inline void wgmma_commit() {}
template <int N> inline void wgmma_wait() {}
inline void fence_proxy_async() {}
inline void pin(u32&) {}
inline void pin(float&) {}

template <int NTILES>
inline void wgmma(float (&c)[NTILES][4], u32 a0, u32 a1, u32 a2, u32 a3, unsigned long long desc) {
    const u32 mine[4] = {a0, a1, a2, a3};
    const int lane = emu::thread_index() & 31, g = lane >> 2, t = lane & 3;
    const unsigned char* b = smem + ((desc & 0x3FFF) << 4);
    const unsigned lbo = ((desc >> 16) & 0x3FFF) << 4, sbo = ((desc >> 32) & 0x3FFF) << 4;
    auto half = [](u32 w, int i) { return emu::f16_value((u16)(w >> (16 * i))); };
    float d[NTILES][4];
    emu::exchange(mine, sizeof mine, [&](auto frag) {
        for (int nt = 0; nt < NTILES; ++nt)
            for (int i = 0; i < 4; ++i) {
                const int r = g + 8 * (i >> 1), n = 8 * nt + 2 * t + (i & 1);
                double s = c[nt][i];
                for (int k = 0; k < 16; ++k) {
                    const u32* fa = (const u32*)frag(4 * (r % 8) + (k % 8) / 2);
                    u16 bk;
                    std::memcpy(&bk, b + (n / 8) * sbo + (n % 8) * 16 + (k / 8) * lbo + (k % 8) * 2, 2);
                    s += half(fa[(r >= 8) + 2 * (k >= 8)], k % 2) * emu::f16_value(bk);
                }
                d[nt][i] = (float)s;
            }
    });
    for (int nt = 0; nt < NTILES; ++nt)
        for (int i = 0; i < 4; ++i)
            c[nt][i] = d[nt][i];
}
#endif
