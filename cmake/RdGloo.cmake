# Finds Gloo (Debian's libgloo-dev) as the imported target RdGloo::gloo and sets RD_GLOO_FOUND.
# Used by the build (RdDependencies.cmake) and installed beside RingDilatedConfig.cmake, which
# includes it too, so the build and its consumers find Gloo the same way.
#
# Debian ships a GlooConfig.cmake whose target is a bare `gloo`; other installs (a source
# build without the config) have only the header and the library. Either way the rest of the
# build sees one name, RdGloo::gloo.
if(TARGET RdGloo::gloo)
  set(RD_GLOO_FOUND TRUE)
  return()
endif()

set(RD_GLOO_FOUND FALSE)
find_package(Gloo CONFIG QUIET)
if(TARGET gloo)
  add_library(RdGloo::gloo INTERFACE IMPORTED)
  target_link_libraries(RdGloo::gloo INTERFACE gloo)
  set(RD_GLOO_FOUND TRUE)
else()
  find_path(RD_GLOO_INCLUDE_DIR gloo/rendezvous/context.h)
  find_library(RD_GLOO_LIBRARY gloo)
  if(RD_GLOO_INCLUDE_DIR AND RD_GLOO_LIBRARY)
    add_library(RdGloo::gloo UNKNOWN IMPORTED)
    set_target_properties(RdGloo::gloo PROPERTIES
      IMPORTED_LOCATION "${RD_GLOO_LIBRARY}"
      INTERFACE_INCLUDE_DIRECTORIES "${RD_GLOO_INCLUDE_DIR}")
    set(RD_GLOO_FOUND TRUE)
  endif()
endif()
