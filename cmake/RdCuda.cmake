# Decides whether the CUDA backend is built (RD_CUDA = AUTO/ON/OFF) and sets RD_WITH_CUDA.
include(CheckLanguage)
set(RD_WITH_CUDA OFF)
if(NOT RD_CUDA STREQUAL "OFF")
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      # Hopper and Ampere by default; override with -DCMAKE_CUDA_ARCHITECTURES=...
      set(CMAKE_CUDA_ARCHITECTURES "80;90" CACHE STRING "CUDA architectures")
    endif()
    enable_language(CUDA)
    # CMake 3.25 predates nvcc's C++20 mode (nvcc >= 12.0 has it) and would refuse CUDA20
    # at generate time; teach it the flag.
    if(NOT CMAKE_CUDA20_STANDARD_COMPILE_OPTION AND CMAKE_CUDA_COMPILER_ID STREQUAL "NVIDIA"
       AND CMAKE_CUDA_COMPILER_VERSION VERSION_GREATER_EQUAL 12.0)
      set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
      set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
    endif()
    set(CMAKE_CUDA_STANDARD 20)
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    find_package(CUDAToolkit REQUIRED)
    set(RD_WITH_CUDA ON)
  elseif(RD_CUDA STREQUAL "ON")
    message(FATAL_ERROR "RD_CUDA=ON but no CUDA compiler was found")
  endif()
endif()
message(STATUS "RingDilated: CUDA backend ${RD_WITH_CUDA}")
