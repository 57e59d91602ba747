# cmake -P script behind the `consumer_package` test (see register.cmake): installs the build
# tree RD_BUILD_DIR into a fresh prefix under RD_WORK_DIR, then configures, builds and runs
# the consumer project against that prefix only; with RD_DEPS_CHECK (CUDA builds), checks
# that the program links no CUDA library. Any failing step fails the test.
foreach(var RD_BUILD_DIR RD_CONSUMER_SOURCE_DIR RD_WORK_DIR RD_GENERATOR RD_CXX_COMPILER)
  if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
    message(FATAL_ERROR "run_consumer.cmake: ${var} is not set")
  endif()
endforeach()

set(prefix "${RD_WORK_DIR}/prefix")
set(build "${RD_WORK_DIR}/build")
file(REMOVE_RECURSE "${RD_WORK_DIR}")
file(MAKE_DIRECTORY "${RD_WORK_DIR}")

# Runs one step, echoing it; stops the script with the step's name when it fails.
function(run_step name)
  string(REPLACE ";" " " shown "${ARGN}")
  message(STATUS "consumer_package: ${name}: ${shown}")
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "consumer_package: step '${name}' failed (${rc})")
  endif()
endfunction()

set(config_args)
if(RD_CONFIG)
  set(config_args --config "${RD_CONFIG}")
endif()
run_step(install "${CMAKE_COMMAND}" --install "${RD_BUILD_DIR}" --prefix "${prefix}" ${config_args})

# The consumer sees nothing of the build tree: only the prefix, the same generator and
# compiler, and (sanitizer builds) the same instrumentation flags.
set(configure_args
  -S "${RD_CONSUMER_SOURCE_DIR}" -B "${build}" -G "${RD_GENERATOR}"
  "-DCMAKE_CXX_COMPILER=${RD_CXX_COMPILER}"
  "-DCMAKE_PREFIX_PATH=${prefix}"
  "-DCMAKE_CXX_FLAGS=${RD_CXX_FLAGS}")
if(RD_MAKE_PROGRAM)
  list(APPEND configure_args "-DCMAKE_MAKE_PROGRAM=${RD_MAKE_PROGRAM}")
endif()
if(RD_CONFIG)
  list(APPEND configure_args "-DCMAKE_BUILD_TYPE=${RD_CONFIG}")
endif()
run_step(configure "${CMAKE_COMMAND}" ${configure_args})

# Guard against a RingDilated found somewhere else (a system-wide install, say).
file(STRINGS "${build}/CMakeCache.txt" found_dir REGEX "^RingDilated_DIR:")
string(REGEX REPLACE "^RingDilated_DIR:[A-Z]+=" "" found_dir "${found_dir}")
file(REAL_PATH "${found_dir}" found_dir)
file(REAL_PATH "${prefix}" real_prefix)
string(FIND "${found_dir}" "${real_prefix}/" at)
if(NOT at EQUAL 0)
  message(FATAL_ERROR "consumer_package: found RingDilated in '${found_dir}', "
                      "not in the fresh prefix '${real_prefix}'")
endif()

run_step(build "${CMAKE_COMMAND}" --build "${build}" ${config_args})

set(exe "${build}/rd_consumer")
if(RD_CONFIG AND NOT EXISTS "${exe}")
  set(exe "${build}/${RD_CONFIG}/rd_consumer")  # multi-config generators
endif()
run_step(run "${exe}")
if(RD_DEPS_CHECK)
  run_step(runtime_deps sh "${RD_DEPS_CHECK}" "${exe}")
endif()
