// Experiment (not part of the crate): copy engine vs SM (kernel) copies over PCIe, alone and
// with the other direction running, 256 MiB pinned buffers, interleaved rounds, medians.
// Build: nvcc -O2 -arch=sm_90 -o sm_copy experiments/sm_copy.cu
#include <cuda_runtime.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#define CK(x)                                                                                     \
    do {                                                                                          \
        cudaError_t e_ = (x);                                                                     \
        if (e_ != cudaSuccess) {                                                                  \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));    \
            exit(1);                                                                              \
        }                                                                                         \
    } while (0)

__global__ void sleep_kernel(long long cycles) {
    long long t0 = clock64();
    while (clock64() - t0 < cycles) {
    }
}

template <int U>
__global__ void __launch_bounds__(512) copy_k(const uint4* __restrict__ src, uint4* __restrict__ dst, size_t n) {
    size_t stride = (size_t)gridDim.x * blockDim.x;
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + (U - 1) * stride < n; i += U * stride) {
        uint4 v[U];
#pragma unroll
        for (int u = 0; u < U; u++) v[u] = src[i + u * stride];
#pragma unroll
        for (int u = 0; u < U; u++) dst[i + u * stride] = v[u];
    }
    for (; i < n; i += stride) dst[i] = src[i];
}

// Block-contiguous variant: each block moves whole contiguous 64 KiB pieces.
template <int U>
__global__ void __launch_bounds__(512) copy_chunk_k(const uint4* __restrict__ src, uint4* __restrict__ dst, size_t n) {
    const size_t piece = 4096;  // uint4s = 64 KiB
    for (size_t base = (size_t)blockIdx.x * piece; base < n; base += (size_t)gridDim.x * piece) {
        size_t end = min(base + piece, n);
        for (size_t i = base + threadIdx.x; i < end; i += U * blockDim.x) {
            uint4 v[U];
#pragma unroll
            for (int u = 0; u < U; u++)
                if (i + u * blockDim.x < end) v[u] = src[i + u * blockDim.x];
#pragma unroll
            for (int u = 0; u < U; u++)
                if (i + u * blockDim.x < end) dst[i + u * blockDim.x] = v[u];
        }
    }
}

static int g_blocks = 264, g_threads = 512, g_variant = 0;

static void sm_copy(void* dst, const void* src, size_t bytes, cudaStream_t s) {
    size_t n = bytes / 16;
    if (g_variant == 0)
        copy_k<4><<<g_blocks, g_threads, 0, s>>>((const uint4*)src, (uint4*)dst, n);
    else if (g_variant == 1)
        copy_k<8><<<g_blocks, g_threads, 0, s>>>((const uint4*)src, (uint4*)dst, n);
    else
        copy_chunk_k<4><<<g_blocks, g_threads, 0, s>>>((const uint4*)src, (uint4*)dst, n);
    CK(cudaGetLastError());
}

enum Eng { NONE, CE, SM };
static const char* eng_name[] = {"-", "ce", "sm"};

struct Res { double up, down; };

static cudaStream_t su, sd;
static cudaEvent_t e0, eu, ed;

static Res run(Eng up, Eng down, char* hs, char* hd, char* dA, char* dB, size_t bytes, int reps) {
    sleep_kernel<<<1, 1, 0, su>>>(4000000);
    CK(cudaGetLastError());
    CK(cudaEventRecord(e0, su));
    CK(cudaStreamWaitEvent(sd, e0, 0));
    for (int r = 0; r < reps; r++) {
        if (up == CE) CK(cudaMemcpyAsync(dA, hs, bytes, cudaMemcpyHostToDevice, su));
        if (up == SM) sm_copy(dA, hs, bytes, su);
        if (down == CE) CK(cudaMemcpyAsync(hd, dB, bytes, cudaMemcpyDeviceToHost, sd));
        if (down == SM) sm_copy(hd, dB, bytes, sd);
    }
    CK(cudaEventRecord(eu, su));
    CK(cudaEventRecord(ed, sd));
    CK(cudaDeviceSynchronize());
    float tu, td;
    CK(cudaEventElapsedTime(&tu, e0, eu));
    CK(cudaEventElapsedTime(&td, e0, ed));
    double moved = (double)bytes * reps;
    return {up ? moved / (tu * 1e-3) / 1e9 : 0, down ? moved / (td * 1e-3) / 1e9 : 0};
}

static double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

int main(int argc, char** argv) {
    int rounds = argc > 1 ? atoi(argv[1]) : 9;
    size_t bytes = 256 << 20;
    char *hs, *hd, *dA, *dB;
    CK(cudaHostAlloc(&hs, bytes, cudaHostAllocDefault));
    CK(cudaHostAlloc(&hd, bytes, cudaHostAllocDefault));
    for (size_t i = 0; i < bytes; i++) hs[i] = (char)(i * 131 + 7) | 1;
    memset(hd, 0, bytes);
    CK(cudaMalloc(&dA, bytes));
    CK(cudaMalloc(&dB, bytes));
    CK(cudaMemcpy(dB, hs, bytes, cudaMemcpyHostToDevice));
    CK(cudaStreamCreateWithFlags(&su, cudaStreamNonBlocking));
    CK(cudaStreamCreateWithFlags(&sd, cudaStreamNonBlocking));
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&eu));
    CK(cudaEventCreate(&ed));
    int sms;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));

    // Check the SM copies move the right bytes.
    g_blocks = sms * 2;
    sm_copy(dA, hs, bytes, su);
    sm_copy(hd, dB, bytes, su);
    CK(cudaStreamSynchronize(su));
    if (memcmp(hd, hs, bytes) != 0) { fprintf(stderr, "sm copy wrong\n"); return 1; }

    struct Cfg { Eng up, down; int blocks, threads, variant; };
    std::vector<Cfg> cfgs = {
        {CE, NONE, 0, 0, 0}, {NONE, CE, 0, 0, 0}, {CE, CE, 0, 0, 0},
    };
    for (int bm : {1, 2, 4})
        for (int var : {0, 1, 2}) {
            cfgs.push_back({SM, NONE, sms * bm, 512, var});
            cfgs.push_back({NONE, SM, sms * bm, 512, var});
        }
    cfgs.push_back({SM, CE, sms * 2, 512, 0});
    cfgs.push_back({CE, SM, sms * 2, 512, 0});
    cfgs.push_back({SM, SM, sms, 512, 0});
    std::vector<std::vector<double>> up(cfgs.size()), down(cfgs.size()), pair(cfgs.size());
    for (int r = 0; r < rounds + 1; r++)
        for (size_t c = 0; c < cfgs.size(); c++) {
            g_blocks = cfgs[c].blocks;
            g_threads = cfgs[c].threads;
            g_variant = cfgs[c].variant;
            Res x = run(cfgs[c].up, cfgs[c].down, hs, hd, dA, dB, bytes, 5);
            if (r == 0) continue;  // warm-up round
            up[c].push_back(x.up);
            down[c].push_back(x.down);
            if (x.up > 0 && x.down > 0) pair[c].push_back(2.0 / std::max(1.0 / x.up, 1.0 / x.down));
        }
    printf("%-4s %-4s %6s %4s %3s %8s %8s %8s %8s\n", "up", "down", "blocks", "thr", "var", "h2d", "d2h",
           "rate-sum", "pair");
    for (size_t c = 0; c < cfgs.size(); c++) {
        double u = up[c].empty() ? 0 : median(up[c]), d = median(down[c]);
        printf("%-4s %-4s %6d %4d %3d %8.2f %8.2f %8.2f %8.2f\n", eng_name[cfgs[c].up], eng_name[cfgs[c].down],
               cfgs[c].blocks, cfgs[c].threads, cfgs[c].variant, u, d, u + d,
               pair[c].empty() ? 0.0 : median(pair[c]));
    }
    if (memcmp(hd, hs, bytes) != 0) { fprintf(stderr, "final d2h wrong\n"); return 1; }
    return 0;
}
