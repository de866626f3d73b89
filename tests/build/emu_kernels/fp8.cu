// fp8 conversions of <cuda_fp8.h> as kernels (tests/build/test_cudaemu_fp8.py). Plain CUDA: compiled by
// the emulator, and (with -DFP8_HOST_MAIN) by nvcc as a host program that runs the CUDA header's own
// conversions on the same inputs, so the emulator is compared with CUDA itself where nvcc exists.
#include <cuda_fp16.h>
#include <cuda_fp8.h>

__host__ __device__ inline __nv_fp8_interpretation_t fmt(int e5m2) { return e5m2 ? __NV_E5M2 : __NV_E4M3; }
__host__ __device__ inline __nv_saturation_t sat_mode(int satfinite) { return satfinite ? __NV_SATFINITE : __NV_NOSAT; }

extern "C" __global__ void fp8_from_float(const float* x, unsigned char* out, int n, int e5m2, int satfinite) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = __nv_cvt_float_to_fp8(x[i], sat_mode(satfinite), fmt(e5m2));
}

extern "C" __global__ void fp8_from_double(const double* x, unsigned char* out, int n, int e5m2, int satfinite) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = __nv_cvt_double_to_fp8(x[i], sat_mode(satfinite), fmt(e5m2));
}

// out[2i] = __nv_cvt_fp8_to_halfraw(code i), out[2i+1] = the same through the x2 conversion.
extern "C" __global__ void fp8_to_half(const unsigned char* codes, unsigned short* out, int n, int e5m2) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  out[2 * i] = __nv_cvt_fp8_to_halfraw(codes[i], fmt(e5m2)).x;
  const __nv_fp8x2_storage_t pair = (__nv_fp8x2_storage_t)(codes[i] | (codes[n - 1 - i] << 8));
  const __half2_raw h2 = __nv_cvt_fp8x2_to_halfraw2(pair, fmt(e5m2));
  out[2 * i + 1] = h2.x;
  if (h2.y != __nv_cvt_fp8_to_halfraw(codes[n - 1 - i], fmt(e5m2)).x) out[2 * i + 1] = 0xdead;
}

// The classes: out[i] = code of __nv_fp8_e4m3(x) / __nv_fp8_e5m2(x); back[i] = float(that value).
extern "C" __global__ void fp8_classes(const float* x, unsigned char* out, float* back, int n, int e5m2) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  if (e5m2) {
    const __nv_fp8_e5m2 v(x[i]);
    out[i] = v.__x;
    back[i] = float(v);
  } else {
    const __nv_fp8_e4m3 v(x[i]);
    out[i] = v.__x;
    back[i] = float(v);
  }
}

#ifdef FP8_HOST_MAIN
#include <cstdio>
#include <vector>
// stdin: n, then n floats (binary); stdout: for e5m2 in {0,1}, satfinite in {0,1}: n codes, then the
// 256 codes -> half bits for e4m3 and e5m2.
int main() {
  int n = 0;
  if (fread(&n, sizeof n, 1, stdin) != 1) return 1;
  std::vector<float> x(n);
  if (fread(x.data(), sizeof(float), n, stdin) != size_t(n)) return 1;
  for (int e5m2 = 0; e5m2 < 2; e5m2++)
    for (int sat = 0; sat < 2; sat++)
      for (int i = 0; i < n; i++) {
        unsigned char c = __nv_cvt_float_to_fp8(x[i], sat_mode(sat), fmt(e5m2));
        fwrite(&c, 1, 1, stdout);
      }
  for (int e5m2 = 0; e5m2 < 2; e5m2++)
    for (int c = 0; c < 256; c++) {
      unsigned short h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)c, fmt(e5m2)).x;
      fwrite(&h, 2, 1, stdout);
    }
  return 0;
}
#endif
