// The entry point of a kernel built for the CPU stand-in (simt_emu.h): g++ ... -DEMU_SOURCE='"path/to/kernel.cu"'
// -DEMU_KERNEL=name; tests/cuda_emu.py calls emu_launch with the addresses of the kernel's arguments in order.
#include "simt_emu.h"

#include EMU_SOURCE

#include <tuple>
#include <utility>

alignas(16) unsigned char smem[emu::kSmemBytes];     // the kernels' `extern __shared__ ... smem[]`

namespace {

template <typename... P, std::size_t... I>
std::function<void()> bind_args(void (*kernel)(P...), void** args, std::index_sequence<I...>) {
    std::tuple<std::decay_t<P>...> values{*static_cast<std::decay_t<P>*>(args[I])...};
    return [kernel, values] { std::apply(kernel, values); };
}

template <typename... P>
std::function<void()> bind_args(void (*kernel)(P...), void** args) {
    return bind_args(kernel, args, std::index_sequence_for<P...>{});
}

char error[512];

}  // namespace

// Runs EMU_KERNEL over grid (gx, gy, gz) of `threads`-thread programs with `smem_bytes` of dynamic shared memory;
// args[i] points at argument i (a pointer, int or unsigned as the kernel declares it); ranges: n_buffers pairs of
// addresses [begin, end), the tensors the kernel may read. Returns "" or the error.
extern "C" const char* emu_launch(unsigned gx, unsigned gy, unsigned gz, unsigned threads, unsigned smem_bytes,
                                  void** args, const unsigned long long* ranges, int n_buffers) {
    emu::buffers.clear();
    for (int i = 0; i < n_buffers; ++i)
        emu::buffers.emplace_back((const char*)ranges[2 * i], (const char*)ranges[2 * i + 1]);
    const std::string why = emu::launch({gx, gy, gz}, {threads, 1, 1}, smem_bytes, bind_args(EMU_KERNEL, args), smem);
    std::snprintf(error, sizeof error, "%s", why.c_str());
    return error;
}
