# Finds the third-party libraries. ./rd setup installs any that are missing.
find_package(absl REQUIRED)
find_package(nlohmann_json 3.10 REQUIRED)
find_package(OpenMP REQUIRED COMPONENTS CXX)
# OpenBLAS provides CBLAS; Debian's package ships an OpenBLASConfig.cmake and a .pc file. Any of
# its builds works (pthread, openmp, serial): the CPU backend sets OpenBLAS's thread count with
# OpenMP's through openblas_set_num_threads (kernels/cpu/parallel.h).
find_package(PkgConfig REQUIRED)
pkg_check_modules(RD_OPENBLAS REQUIRED IMPORTED_TARGET openblas)
if(RD_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()
if(RD_BUILD_BENCH)
  find_package(benchmark REQUIRED)
endif()

# Gloo (Debian's libgloo-dev) carries the multi-process CPU communicator (dist/gloo.cc). It is
# optional: without it that backend is left out (dist/gloo_missing.cc stands in, failing with
# kUnimplemented) and the tests that need it skip. AUTO builds it when found, ON requires it.
set(RD_GLOO "AUTO" CACHE STRING "Build the Gloo communicator: AUTO, ON or OFF")
set_property(CACHE RD_GLOO PROPERTY STRINGS AUTO ON OFF)
set(RD_WITH_GLOO OFF)
if(NOT RD_GLOO STREQUAL "OFF")
  include(RdGloo)
  if(RD_GLOO_FOUND)
    set(RD_WITH_GLOO ON)
  elseif(RD_GLOO STREQUAL "ON")
    message(FATAL_ERROR "RD_GLOO=ON but Gloo was not found (on Debian: apt-get install libgloo-dev)")
  endif()
endif()
if(RD_WITH_GLOO)
  message(STATUS "Gloo: found; building the gloo communicator")
else()
  message(STATUS "Gloo: not built (RD_GLOO=${RD_GLOO}); multi-process tests will skip")
endif()
