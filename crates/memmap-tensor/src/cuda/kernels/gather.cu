// Row gathers into device memory, reading the source rows where they are: device memory, or
// host memory (a mapped file, shared memory, the heap) registered with the driver and read
// over PCIe through its device address. One launch gathers every leaf of a dict: block
// (x, y) copies rows x, x + gridDim.x, ... of leaf y.
//
// Compiled to PTX by tools/cuda/build_ptx.py (NVRTC, compute_70), which writes gather.ptx
// beside this file; the driver compiles the PTX for the GPU it runs on. Edit this file, run
// that script, and commit both.

struct Leaf {
    const unsigned char* src;   // row 0 of the source
    unsigned char* dst;         // row 0 of the output (`rows` rows, contiguous)
    unsigned long long row_bytes;
};

template <typename Word>
__device__ void copy_words(const unsigned char* src, unsigned char* dst, unsigned long long bytes) {
    const Word* s = reinterpret_cast<const Word*>(src);
    Word* d = reinterpret_cast<Word*>(dst);
    const unsigned long long n = bytes / sizeof(Word);
    for (unsigned long long i = threadIdx.x; i < n; i += blockDim.x) {
        d[i] = s[i];
    }
}

// `rows` holds row numbers already checked against each leaf's row count on the host.
extern "C" __global__ void gather_rows(const Leaf* leaves, const long long* rows, unsigned int n_rows) {
    const Leaf leaf = leaves[blockIdx.y];
    for (unsigned int r = blockIdx.x; r < n_rows; r += gridDim.x) {
        const unsigned char* src = leaf.src + (unsigned long long)rows[r] * leaf.row_bytes;
        unsigned char* dst = leaf.dst + (unsigned long long)r * leaf.row_bytes;
        const unsigned long long align =
            (unsigned long long)src | (unsigned long long)dst | leaf.row_bytes;
        if (align % 16 == 0) {
            copy_words<uint4>(src, dst, leaf.row_bytes);
        } else if (align % 8 == 0) {
            copy_words<unsigned long long>(src, dst, leaf.row_bytes);
        } else if (align % 4 == 0) {
            copy_words<unsigned int>(src, dst, leaf.row_bytes);
        } else {
            copy_words<unsigned char>(src, dst, leaf.row_bytes);
        }
    }
}
