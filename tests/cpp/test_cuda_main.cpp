// Entry point of the CUDA kernel tests: without a usable GPU there is nothing to
// run, and exit code 77 tells ctest to report the test as skipped, not passed.
#define CATCH_CONFIG_RUNNER
#include <cuda_runtime_api.h>

#include <catch2/catch.hpp>
#include <cstdio>

int main(int argc, char* argv[]) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("No CUDA device: the CUDA kernel tests are skipped.\n");
    return 77;
  }
  return Catch::Session().run(argc, argv);
}
