// Experiment (not part of the crate): does the backing of host memory change large-copy
// bandwidth? cudaHostAlloc vs cudaHostRegister of 4 KiB pages vs transparent huge pages,
// H2D / D2H / bidirectional, 16 MiB and 256 MiB, plus splitting each direction over 2 streams.
// Build on the device: nvcc -O2 -arch=sm_90 -o hostmem_bw experiments/hostmem_bw.cu
#include <cuda_runtime.h>
#include <sys/mman.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#define CK(x)                                                                         \
    do {                                                                              \
        cudaError_t e_ = (x);                                                         \
        if (e_ != cudaSuccess) {                                                      \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
            exit(1);                                                                  \
        }                                                                             \
    } while (0)

__global__ void sleep_kernel(long long ns) {
    long long t0 = clock64();
    while (clock64() - t0 < ns * 2) {
    }
}

enum Back { HOSTALLOC, REG4K, REGTHP, HOSTALLOC_WC };
static const char* back_name[] = {"hostalloc", "register-4k", "register-thp", "hostalloc-wc"};

static void* alloc_host(Back b, size_t n) {
    void* p = nullptr;
    if (b == HOSTALLOC || b == HOSTALLOC_WC) {
        CK(cudaHostAlloc(&p, n, b == HOSTALLOC ? cudaHostAllocDefault : cudaHostAllocWriteCombined));
        memset(p, 0x5a, n);
        return p;
    }
    size_t align = 2 << 20;
    void* raw = mmap(nullptr, n + align, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) { perror("mmap"); exit(1); }
    p = (void*)(((uintptr_t)raw + align - 1) & ~(uintptr_t)(align - 1));
    if (madvise(p, n, b == REGTHP ? MADV_HUGEPAGE : MADV_NOHUGEPAGE) != 0) perror("madvise");
    memset(p, 0x5a, n);
    CK(cudaHostRegister(p, n, cudaHostRegisterDefault));
    return p;
}

static long anon_huge_kb() {
    FILE* f = fopen("/proc/self/smaps_rollup", "r");
    if (!f) return -1;
    char line[256];
    long kb = -1;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "AnonHugePages: %ld kB", &kb) == 1) break;
    fclose(f);
    return kb;
}

struct Res { double h2d, d2h; };

// nstreams streams per direction; each copy of `bytes` is split evenly over them.
// which: 1 = h2d only, 2 = d2h only, 3 = both. ws: host working set (bytes); copies walk it.
static Res run(char* hsrc, char* hdst, char* dA, char* dB, size_t bytes, size_t ws, int which,
               int nstreams, int reps) {
    std::vector<cudaStream_t> up(nstreams), down(nstreams);
    for (int i = 0; i < nstreams; i++) {
        CK(cudaStreamCreateWithFlags(&up[i], cudaStreamNonBlocking));
        CK(cudaStreamCreateWithFlags(&down[i], cudaStreamNonBlocking));
    }
    cudaEvent_t start;
    std::vector<cudaEvent_t> eu(nstreams), ed(nstreams);
    CK(cudaEventCreate(&start));
    for (int i = 0; i < nstreams; i++) { CK(cudaEventCreate(&eu[i])); CK(cudaEventCreate(&ed[i])); }
    sleep_kernel<<<1, 1, 0, up[0]>>>(2000000);
    CK(cudaGetLastError());
    CK(cudaEventRecord(start, up[0]));
    for (int i = 0; i < nstreams; i++) {
        CK(cudaStreamWaitEvent(up[i], start, 0));
        CK(cudaStreamWaitEvent(down[i], start, 0));
    }
    size_t part = bytes / nstreams;
    size_t slots = ws / bytes;
    for (int r = 0; r < reps; r++) {
        size_t off = (r % slots) * bytes;
        for (int i = 0; i < nstreams; i++) {
            if (which & 1)
                CK(cudaMemcpyAsync(dA + i * part, hsrc + off + i * part, part, cudaMemcpyHostToDevice, up[i]));
            if (which & 2)
                CK(cudaMemcpyAsync(hdst + off + i * part, dB + i * part, part, cudaMemcpyDeviceToHost, down[i]));
        }
    }
    for (int i = 0; i < nstreams; i++) {
        CK(cudaEventRecord(eu[i], up[i]));
        CK(cudaEventRecord(ed[i], down[i]));
    }
    CK(cudaDeviceSynchronize());
    float tu = 0, td = 0;
    for (int i = 0; i < nstreams; i++) {
        float t;
        CK(cudaEventElapsedTime(&t, start, eu[i])); tu = std::max(tu, t);
        CK(cudaEventElapsedTime(&t, start, ed[i])); td = std::max(td, t);
    }
    for (int i = 0; i < nstreams; i++) {
        CK(cudaStreamDestroy(up[i])); CK(cudaStreamDestroy(down[i]));
        CK(cudaEventDestroy(eu[i])); CK(cudaEventDestroy(ed[i]));
    }
    CK(cudaEventDestroy(start));
    double moved = (double)bytes * reps;
    Res r{0, 0};
    if (which & 1) r.h2d = moved / (tu * 1e-3) / 1e9;
    if (which & 2) r.d2h = moved / (td * 1e-3) / 1e9;
    return r;
}

static double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

int main(int argc, char** argv) {
    size_t big = 256 << 20;
    size_t maxws = 256 << 20;
    char *dA, *dB;
    CK(cudaMalloc(&dA, big));
    CK(cudaMalloc(&dB, big));
    CK(cudaMemset(dA, 1, big));
    CK(cudaMemset(dB, 2, big));
    // Variants of moving 256 MiB, measured in interleaved rounds so that drift of the link
    // (seen: the same case 99.6 then 74.6 GB/s a minute later) hits every variant alike.
    struct Var { size_t chunk; int st; size_t ws; };
    std::vector<Var> vars = {{256 << 20, 1, 256 << 20}, {16 << 20, 1, 256 << 20},
                             {16 << 20, 1, 64 << 20}, {16 << 20, 1, 16 << 20},
                             {64 << 20, 1, 64 << 20}};
    int rounds = argc > 1 ? atoi(argv[1]) : 25;
    for (Back b : {HOSTALLOC, REGTHP}) {
        char* hs = (char*)alloc_host(b, maxws);
        char* hd = (char*)alloc_host(b, maxws);
        std::vector<std::vector<double>> h(vars.size()), d(vars.size()), bs(vars.size()), bu(vars.size());
        for (size_t v = 0; v < vars.size(); v++) run(hs, hd, dA, dB, vars[v].chunk, vars[v].ws, 3, vars[v].st, 4);
        for (int r = 0; r < rounds; r++)
            for (size_t v = 0; v < vars.size(); v++) {
                int reps = (int)((256ull << 20) * 5 / vars[v].chunk);
                h[v].push_back(run(hs, hd, dA, dB, vars[v].chunk, vars[v].ws, 1, vars[v].st, reps).h2d);
                d[v].push_back(run(hs, hd, dA, dB, vars[v].chunk, vars[v].ws, 2, vars[v].st, reps).d2h);
                Res x = run(hs, hd, dA, dB, vars[v].chunk, vars[v].ws, 3, vars[v].st, reps);
                bu[v].push_back(x.h2d);
                bs[v].push_back(2.0 / std::max(1.0 / x.h2d, 1.0 / x.d2h));
            }
        printf("%-14s %6s %6s %3s %8s %8s %8s %8s %8s %8s\n", "backing", "chunk", "ws", "st", "h2d", "h2d-max", "d2h",
               "bi-h2d", "bi-sum", "sum-max");
        for (size_t v = 0; v < vars.size(); v++)
            printf("%-14s %5zuM %5zuM %3d %8.2f %8.2f %8.2f %8.2f %8.2f %8.2f\n", back_name[b], vars[v].chunk >> 20,
                   vars[v].ws >> 20, vars[v].st, median(h[v]), *std::max_element(h[v].begin(), h[v].end()), median(d[v]),
                   median(bu[v]), median(bs[v]), *std::max_element(bs[v].begin(), bs[v].end()));
        fflush(stdout);
        if (b == HOSTALLOC) { CK(cudaFreeHost(hs)); CK(cudaFreeHost(hd)); }
        else { CK(cudaHostUnregister(hs)); CK(cudaHostUnregister(hd)); }
    }
    return 0;
}
