# rd_add_library(): one library per folder, sources globbed from that folder, warnings and
# sanitizers applied uniformly so no target drifts from the project's flags.
set(RD_WARNING_FLAGS -Wall -Wextra)
if(RD_WERROR)
  list(APPEND RD_WARNING_FLAGS -Werror)
endif()
set(RD_SANITIZER_FLAGS)
if(RD_SANITIZE)
  set(RD_SANITIZER_FLAGS -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined)
endif()

function(rd_apply_flags target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:${RD_WARNING_FLAGS} ${RD_SANITIZER_FLAGS}>
    $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra --expt-relaxed-constexpr>)
  if(RD_SANITIZE)
    target_link_options(${target} PRIVATE ${RD_SANITIZER_FLAGS})
  endif()
endfunction()

# rd_add_library(NAME folder SOURCES ... [DEPS ...]) builds a library named rd_<folder>.
function(rd_add_library name)
  cmake_parse_arguments(ARG "" "" "SOURCES;PUBLIC_DEPS;PRIVATE_DEPS" ${ARGN})
  add_library(${name} ${ARG_SOURCES})
  add_library(RingDilated::${name} ALIAS ${name})
  target_include_directories(${name} PUBLIC
    $<BUILD_INTERFACE:${RD_BUILD_INCLUDE_DIR}>
    $<INSTALL_INTERFACE:include>)
  target_link_libraries(${name} PUBLIC ${ARG_PUBLIC_DEPS} PRIVATE ${ARG_PRIVATE_DEPS})
  target_compile_features(${name} PUBLIC cxx_std_20)
  set_target_properties(${name} PROPERTIES EXPORT_NAME ${name})
  if(RD_SANITIZE)
    target_link_options(${name} INTERFACE ${RD_SANITIZER_FLAGS})
  endif()
  rd_apply_flags(${name})
  set_property(GLOBAL APPEND PROPERTY RD_LIBRARIES ${name})
endfunction()
