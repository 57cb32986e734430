// The PTX instructions the tensor-core kernels use (q8_mma.cu, moe_mma.cu), as inline functions. Kept apart so that tests can
// run the kernels' CUDA C++ on the CPU: tests/cuda_emu/simt_emu.h defines these same functions for a host build and
// DS4_PTX_OPS_CUH, so this file is skipped there.
#ifndef DS4_PTX_OPS_CUH
#define DS4_PTX_OPS_CUH

typedef unsigned int u32;
typedef unsigned short u16;

// programmatic dependent launch (pdl.py's contract), a kernel's first statement: wait for the kernel before it, then
// let the next one be scheduled (sm_90+; nothing on older targets)
__device__ __forceinline__ void pdl_enter() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;");
#endif
}

// a 16-byte load that stays before pdl_enter's wait (a kernel's weights, which the kernel before it never writes:
// their latency then overlaps that kernel's end). A volatile asm keeps NVVM from moving it past the wait's, and it is
// a coherent ld.global: ptxas hoists the wait above ld.global.nc (__ldg) loads
__device__ __forceinline__ uint4 ldg_before_wait(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}

__device__ __forceinline__ u32 sub_f16x2(u32 a, u32 b) {
    u32 d;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

__device__ __forceinline__ u32 mul_f16x2(u32 a, u32 b) {
    u32 d;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

__device__ __forceinline__ u32 add_f16x2(u32 a, u32 b) {
    u32 d;
    asm("add.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

__device__ __forceinline__ u32 fma_f16x2(u32 a, u32 b, u32 c) {
    u32 d;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// c += A [16 x 16] @ B [16 x 8] (A row-major fragment a0..a3, B column fragment b0, b1, c the [16 x 8] fragment)
__device__ __forceinline__ void mma(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// 16 bytes global -> shared without registers (cp.async, sm_80+); visible to this thread after cp_async_wait, to the
// others after a barrier
__device__ __forceinline__ void cp_async16(void* shared_dst, const void* global_src) {
    const u32 dst = (u32)__cvta_generic_to_shared(shared_dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(global_src) : "memory");
}

// cp_async16 reading only the first n (0..16) bytes of src, the rest of the 16 bytes of dst zero (cp.async's src-size)
__device__ __forceinline__ void cp_async16_n(void* shared_dst, const void* global_src, int n) {
    const u32 dst = (u32)__cvta_generic_to_shared(shared_dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(global_src), "r"(n) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

__device__ __forceinline__ void cp_async8(void* shared_dst, const void* global_src) {
    const u32 dst = (u32)__cvta_generic_to_shared(shared_dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" ::"r"(dst), "l"(global_src) : "memory");
}

// wait until at most N of this thread's committed groups are still in flight
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

#if WG
// wgmma (sm_90a: moe_mma.cu's WG kernels). A from registers (each warp of the warpgroup its 16 rows, mma's A fragment
// layout), B from shared memory through a descriptor, D the accumulators (each warp its 16 rows, mma's C layout per 8
// columns). The instructions are asynchronous: fence before the first after the registers were written, commit the
// batch, wait before the registers are read or written again.

// the descriptor of a B tile of core matrices (8 rows of 16 bytes each) in shared memory without swizzling: lbo the
// bytes between core matrices adjacent along K, sbo along N; PTX ISA "matrix descriptor format"
__device__ __forceinline__ unsigned long long smem_desc(const void* p, u32 lbo, u32 sbo) {
    const u32 a = (u32)__cvta_generic_to_shared(p);
    return (unsigned long long)((a & 0x3FFFF) >> 4) | (unsigned long long)(lbo >> 4) << 16 |
           (unsigned long long)(sbo >> 4) << 32;
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory"); }
// shared memory written by this thread's ordinary stores or cp.async, read next by the tensor cores (async proxy)
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// a register's value taken and given back at this point: its writes stay before, its reads after (no code)
__device__ __forceinline__ void pin(u32& r) { asm volatile("" : "+r"(r)::"memory"); }
__device__ __forceinline__ void pin(float& f) { asm volatile("" : "+f"(f)::"memory"); }

#define WG_C4(i) "+f"(c[i][0]), "+f"(c[i][1]), "+f"(c[i][2]), "+f"(c[i][3])

// c [64 x 8 NTILES] += A [64 x 16] (this warp's rows: a0..a3) @ B [16 x 8 NTILES] (desc)
template <int NTILES>
__device__ __forceinline__ void wgmma(float (&c)[NTILES][4], u32 a0, u32 a1, u32 a2, u32 a3, unsigned long long desc) {
    static_assert(NTILES == 4 || NTILES == 8, "wgmma: 32 or 64 columns");
    if constexpr (NTILES == 4)
        asm volatile("wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 "
                     "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, {%16,%17,%18,%19}, %20, %21, 1, 1, 0;"
                     : WG_C4(0), WG_C4(1), WG_C4(2), WG_C4(3)
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "n"(1));
    else
        asm volatile("wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
                     "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
                     "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, %37, "
                     "1, 1, 0;"
                     : WG_C4(0), WG_C4(1), WG_C4(2), WG_C4(3), WG_C4(4), WG_C4(5), WG_C4(6), WG_C4(7)
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "n"(1));
}
#undef WG_C4
#endif

#endif
