# Finds the third-party libraries. ./rd setup installs any that are missing.
find_package(absl REQUIRED)
find_package(nlohmann_json 3.10 REQUIRED)
find_package(OpenMP REQUIRED COMPONENTS CXX)
# OpenBLAS provides CBLAS; Debian's package ships an OpenBLASConfig.cmake and a .pc file.
find_package(PkgConfig REQUIRED)
pkg_check_modules(RD_OPENBLAS REQUIRED IMPORTED_TARGET openblas)
if(RD_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()
if(RD_BUILD_BENCH)
  find_package(benchmark REQUIRED)
endif()
