// Libraries opened at run time (kernels/shared_library.h): a library that opens resolves
// working entry points, a missing library or symbol becomes a message naming it; in CUDA
// builds, cuBLASLt and cuDNN load this way (no GPU needed to load them).
#include "ringdilated/kernels/shared_library.h"

#include <dlfcn.h>

#include <cmath>
#include <string>

#include "gtest/gtest.h"
#include "testing/raises.h"

#if defined(RD_WITH_CUDA)
#include "ringdilated/kernels/cuda/cublaslt_api.h"
#include "ringdilated/kernels/cuda/cudnn_attention.h"
#endif

namespace rd::kernels {
namespace {

// glibc's math library: present wherever the tests run, with a soname that does not change.
constexpr const char* kLibm = "libm.so.6";
constexpr const char* kMissing = "librd-no-such-library.so.7";
constexpr const char* kMissingPath = "/rd/no/such/dir/librd-other.so";

using CosineFn = double (*)(double);

TEST(SharedLibrary, ResolvesWorkingEntryPoints) {
  SharedLibrary library = open_shared_library("libm", {kLibm});
  ASSERT_TRUE(library.usable()) << library.problem;
  CosineFn cosine = nullptr;
  library.resolve("cos", &cosine);
  ASSERT_NE(cosine, nullptr) << library.problem;
  for (double x : {-2.75, 0.3, 1.0, 5.5}) EXPECT_EQ(cosine(x), std::cos(x)) << "x = " << x;
  EXPECT_TRUE(library.usable()) << library.problem;
}

TEST(SharedLibrary, TakesTheFirstCandidateThatOpens) {
  SharedLibrary library = open_shared_library("libm", {kMissing, kMissingPath, kLibm});
  ASSERT_TRUE(library.usable()) << library.problem;
  // The handle is libm's own: the same one dlopen gives for its soname.
  void* direct = dlopen(kLibm, RTLD_NOW | RTLD_LOCAL);
  ASSERT_NE(direct, nullptr);
  EXPECT_EQ(library.handle, direct);
  dlclose(direct);
}

TEST(SharedLibrary, MissingLibraryNamesItAndEveryCandidate) {
  SharedLibrary library = open_shared_library("the frobnicator", {kMissing, kMissingPath});
  EXPECT_FALSE(library.usable());
  EXPECT_EQ(library.handle, nullptr);
  for (const char* fragment : {"the frobnicator could not be loaded", kMissing, kMissingPath}) {
    EXPECT_NE(library.problem.find(fragment), std::string::npos)
        << "missing \"" << fragment << "\" in: " << library.problem;
  }
  // Resolving from it gives null and keeps the first problem.
  const std::string first = library.problem;
  CosineFn cosine = &std::cos;
  library.resolve("cos", &cosine);
  EXPECT_EQ(cosine, nullptr);
  EXPECT_EQ(library.problem, first);
}

TEST(SharedLibrary, MissingSymbolNamesLibraryAndSymbol) {
  SharedLibrary library = open_shared_library("libm", {kLibm});
  ASSERT_TRUE(library.usable()) << library.problem;
  CosineFn missing = &std::cos, also_missing = &std::sin, cosine = nullptr;
  library.resolve("rd_no_such_symbol", &missing);
  library.resolve("rd_no_such_symbol_either", &also_missing);
  library.resolve("cos", &cosine);
  EXPECT_EQ(missing, nullptr);
  EXPECT_EQ(also_missing, nullptr);
  EXPECT_NE(cosine, nullptr);  // other symbols still resolve
  EXPECT_FALSE(library.usable());
  EXPECT_NE(library.problem.find("libm has no rd_no_such_symbol "), std::string::npos)
      << library.problem;
  EXPECT_EQ(library.problem.find("rd_no_such_symbol_either"), std::string::npos)
      << "the first problem is kept: " << library.problem;
}

TEST(SharedLibrary, SymbolFromANeverOpenedLibrary) {
  SharedLibrary library;
  library.name = "nothing";
  EXPECT_EQ(library.find_symbol("cos"), nullptr);
  EXPECT_EQ(library.problem, "nothing is not loaded");
}

#if defined(RD_WITH_CUDA)
// Whether the dynamic loader finds `soname` by itself (an independent check of what the
// library's own loading should find).
bool loader_finds(const std::string& soname) {
  void* handle = dlopen(soname.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle != nullptr) dlclose(handle);
  return handle != nullptr;
}

// No GPU is needed: loading cuBLASLt and naming a status touch no device. Where the library
// is missing the first GEMM fails with kUnimplemented naming it, not the program's start.
TEST(SharedLibrary, CublasLtLoadsOnFirstUse) {
  const std::string soname = "libcublasLt.so." + std::to_string(CUBLAS_VER_MAJOR);
  const cuda::CublasLtApi* lt = nullptr;
  try {
    lt = &cuda::cublaslt_api("gemm");
  } catch (const Error& e) {
    // Only acceptable where the loader cannot find it either.
    EXPECT_FALSE(loader_finds(soname)) << e.what();
    EXPECT_TRUE(test::raises([] { cuda::cublaslt_api("gemm"); }, {ErrorCode::kUnimplemented},
                             {"gemm", "cuBLASLt", soname}));
    return;
  }
  ASSERT_NE(lt->get_status_name, nullptr);
  ASSERT_NE(lt->matmul, nullptr);
  EXPECT_STREQ(lt->get_status_name(CUBLAS_STATUS_NOT_SUPPORTED), "CUBLAS_STATUS_NOT_SUPPORTED");
  EXPECT_EQ(&cuda::cublaslt_api("again"), lt);  // loaded once
}

#if defined(RD_WITH_CUDNN)
// Where cuDNN or the shared runtime its frontend calls is missing, the path is unavailable
// (version 0), and nothing crashes; where the loader finds both, it is available.
TEST(SharedLibrary, CudnnLoadsOnFirstUse) {
  const std::string cudart = "libcudart.so." + std::to_string(CUDART_VERSION / 1000);
  const bool available = cuda::cudnn_attention_available();
  EXPECT_EQ(available, cuda::cudnn_runtime_version() >= 90000)
      << "version " << cuda::cudnn_runtime_version();
  if (loader_finds("libcudnn.so.9") && loader_finds(cudart)) {
    EXPECT_TRUE(available);
  }
}
#endif
#endif

}  // namespace
}  // namespace rd::kernels
