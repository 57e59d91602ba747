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
    # Every test and bench program links the device code of all kernels (~36 MB of fatbin
    # each at nvcc's default compression, 2.3 GB over the build tree; CI ran out of disk).
    # Compressing for size shrinks it ~6x; the driver inflates each module once, when it is
    # loaded. Only from CUDA 13 on, whose drivers (580+) all read this compression.
    if(CMAKE_CUDA_COMPILER_ID STREQUAL "NVIDIA" AND CMAKE_CUDA_COMPILER_VERSION VERSION_GREATER_EQUAL 13.0)
      add_compile_options("$<$<COMPILE_LANGUAGE:CUDA>:--compress-mode=size>")
    endif()
    find_package(CUDAToolkit REQUIRED)
    set(RD_WITH_CUDA ON)
  elseif(RD_CUDA STREQUAL "ON")
    message(FATAL_ERROR "RD_CUDA=ON but no CUDA compiler was found")
  endif()
endif()
message(STATUS "RingDilated: CUDA backend ${RD_WITH_CUDA}")

# cuDNN for the kCudnn attention path (kernels/cuda/cudnn_attention.cc): cudnn.h and
# libcudnn (9 or newer; they come with the CUDA toolkit) plus the header-only cudnn-frontend,
# which `./rd setup` unpacks into .whl/cudnn_frontend/include. Sets RD_WITH_CUDNN when all
# three are found; without them the path reports itself unavailable at run time. The library
# is opened at run time (dlopen), so it is found here only to check that it is there (its
# folder is the fallback after the loader's search path).
set(RD_WITH_CUDNN OFF)
set(RD_CUDNN_FRONTEND_INCLUDE_DIR "${PROJECT_SOURCE_DIR}/.whl/cudnn_frontend/include"
    CACHE PATH "Folder holding cudnn_frontend.h (from PyPI's nvidia-cudnn-frontend)")
if(RD_WITH_CUDA)
  get_filename_component(RD_CUDA_ROOT_GUESS "${CUDAToolkit_BIN_DIR}" DIRECTORY)
  find_path(RD_CUDNN_INCLUDE_DIR cudnn.h
            HINTS ENV CUDNN_PATH ${CUDAToolkit_INCLUDE_DIRS} "${RD_CUDA_ROOT_GUESS}"
            PATH_SUFFIXES include)
  find_library(RD_CUDNN_LIBRARY cudnn
               HINTS ENV CUDNN_PATH ${CUDAToolkit_LIBRARY_DIR} "${RD_CUDA_ROOT_GUESS}"
               PATH_SUFFIXES lib lib64 lib/x64)
  set(RD_CUDNN_VERSION "")
  if(RD_CUDNN_INCLUDE_DIR AND EXISTS "${RD_CUDNN_INCLUDE_DIR}/cudnn_version.h")
    file(STRINGS "${RD_CUDNN_INCLUDE_DIR}/cudnn_version.h" RD_CUDNN_VERSION_LINES
         REGEX "^#define CUDNN_(MAJOR|MINOR|PATCHLEVEL) +[0-9]+")
    foreach(part MAJOR MINOR PATCHLEVEL)
      string(REGEX MATCH "CUDNN_${part} +([0-9]+)" _ "${RD_CUDNN_VERSION_LINES}")
      list(APPEND RD_CUDNN_VERSION "${CMAKE_MATCH_1}")
    endforeach()
    list(JOIN RD_CUDNN_VERSION "." RD_CUDNN_VERSION)
  endif()
  if(NOT RD_CUDNN_INCLUDE_DIR OR NOT RD_CUDNN_LIBRARY)
    message(STATUS "RingDilated: cuDNN attention OFF (cudnn.h or libcudnn not found; "
                   "set CUDNN_PATH to a cuDNN 9 install)")
  elseif(NOT RD_CUDNN_VERSION OR RD_CUDNN_VERSION VERSION_LESS 9)
    message(STATUS "RingDilated: cuDNN attention OFF (cuDNN ${RD_CUDNN_VERSION} found, 9 or "
                   "newer is needed)")
  elseif(NOT EXISTS "${RD_CUDNN_FRONTEND_INCLUDE_DIR}/cudnn_frontend.h")
    message(STATUS "RingDilated: cuDNN attention OFF (no cudnn_frontend.h in "
                   "RD_CUDNN_FRONTEND_INCLUDE_DIR=${RD_CUDNN_FRONTEND_INCLUDE_DIR}; "
                   "`./rd setup` installs it)")
  else()
    set(RD_WITH_CUDNN ON)
    message(STATUS "RingDilated: cuDNN attention ON (cuDNN ${RD_CUDNN_VERSION}: "
                   "${RD_CUDNN_LIBRARY}; frontend: ${RD_CUDNN_FRONTEND_INCLUDE_DIR})")
  endif()
else()
  message(STATUS "RingDilated: cuDNN attention OFF (no CUDA backend)")
endif()
