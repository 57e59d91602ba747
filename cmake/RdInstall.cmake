# Install rules and the CMake package: headers under include/ringdilated/<folder>/, every
# folder library plus the umbrella target in the export set RingDilated::, and a config that
# re-finds the libraries' link dependencies so that an outside project only needs
#   find_package(RingDilated REQUIRED)
#   target_link_libraries(app PRIVATE RingDilated::ringdilated)
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

set(RD_INSTALL_INCLUDE_DIR "${CMAKE_INSTALL_INCLUDEDIR}/ringdilated")
set(RD_INSTALL_CMAKE_DIR "${CMAKE_INSTALL_LIBDIR}/cmake/RingDilated")

# Headers keep their folder so that "ringdilated/<folder>/<file>.h" resolves against
# <prefix>/include exactly as it does against the build tree's include link. The CUDA
# headers need cuda_runtime.h, so only CUDA builds install them.
set(RD_HEADER_EXCLUDES)
if(NOT RD_WITH_CUDA)
  set(RD_HEADER_EXCLUDES PATTERN "cuda" EXCLUDE)
endif()
foreach(folder kernels tensor dist nn train)
  install(DIRECTORY "${PROJECT_SOURCE_DIR}/${folder}/"
          DESTINATION "${RD_INSTALL_INCLUDE_DIR}/${folder}"
          FILES_MATCHING PATTERN "*.h" ${RD_HEADER_EXCLUDES})
endforeach()
install(FILES "${PROJECT_SOURCE_DIR}/ringdilated.h" DESTINATION "${RD_INSTALL_INCLUDE_DIR}")

# Every folder library registers itself in RD_LIBRARIES, whether it is a real (static)
# library or still an INTERFACE placeholder, so new folders are picked up without edits here.
get_property(RD_INSTALLED_LIBRARIES GLOBAL PROPERTY RD_LIBRARIES)
list(REMOVE_DUPLICATES RD_INSTALLED_LIBRARIES)
install(TARGETS ${RD_INSTALLED_LIBRARIES} ringdilated
        EXPORT RingDilatedTargets
        ARCHIVE DESTINATION "${CMAKE_INSTALL_LIBDIR}"
        LIBRARY DESTINATION "${CMAKE_INSTALL_LIBDIR}"
        RUNTIME DESTINATION "${CMAKE_INSTALL_BINDIR}"
        INCLUDES DESTINATION "${CMAKE_INSTALL_INCLUDEDIR}")
install(EXPORT RingDilatedTargets
        NAMESPACE RingDilated::
        DESTINATION "${RD_INSTALL_CMAKE_DIR}")

# The config re-creates what the exported targets name: absl, nlohmann_json, OpenMP, the
# OpenBLAS pkg-config target, RdGloo::gloo in Gloo builds and, in CUDA builds,
# CUDA::cudart_static (the only CUDA library linked: cuBLASLt and cuDNN are opened at run time,
# so programs built against the package start without any CUDA library installed).
if(RD_WITH_CUDA)
  set(RD_CONFIG_CUDA_ROOT "")
  if(CUDAToolkit_BIN_DIR)
    get_filename_component(RD_CONFIG_CUDA_ROOT "${CUDAToolkit_BIN_DIR}" DIRECTORY)
  endif()
endif()
configure_package_config_file(
  "${CMAKE_CURRENT_LIST_DIR}/RingDilatedConfig.cmake.in"
  "${PROJECT_BINARY_DIR}/RingDilatedConfig.cmake"
  INSTALL_DESTINATION "${RD_INSTALL_CMAKE_DIR}")
# 0.x releases may break the API between minor versions, hence SameMinorVersion.
write_basic_package_version_file(
  "${PROJECT_BINARY_DIR}/RingDilatedConfigVersion.cmake"
  VERSION "${PROJECT_VERSION}"
  COMPATIBILITY SameMinorVersion)
install(FILES "${PROJECT_BINARY_DIR}/RingDilatedConfig.cmake"
              "${PROJECT_BINARY_DIR}/RingDilatedConfigVersion.cmake"
        DESTINATION "${RD_INSTALL_CMAKE_DIR}")
# rd_dist links Gloo when built with it: the config finds it with the build's own module.
if(RD_WITH_GLOO)
  install(FILES "${CMAKE_CURRENT_LIST_DIR}/RdGloo.cmake" DESTINATION "${RD_INSTALL_CMAKE_DIR}")
endif()
