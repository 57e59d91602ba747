# Registers the ctest test `consumer_package`: install this build into a fresh prefix, then
# configure, build and run the outside project in tests/consumer against it. Included by
# tests/CMakeLists.txt.
#
# Sanitizer builds: the installed static libraries carry -fsanitize=... in their link
# interface, so the consumer links; its own main.cc is compiled with the same flags so
# that it runs fully instrumented too.
set(RD_CONSUMER_WORK_DIR "${CMAKE_CURRENT_BINARY_DIR}/consumer_package")
set(RD_CONSUMER_CXX_FLAGS "")
# CUDA builds: the consumer program must not link a CUDA library either (see
# tests/runtime_deps_test.sh), so that users of the package run on machines without them.
set(RD_CONSUMER_DEPS_CHECK "")
if(RD_WITH_CUDA)
  set(RD_CONSUMER_DEPS_CHECK "${CMAKE_CURRENT_SOURCE_DIR}/runtime_deps_test.sh")
endif()
if(RD_SANITIZE)
  list(JOIN RD_SANITIZER_FLAGS " " RD_CONSUMER_CXX_FLAGS)
endif()

add_test(NAME consumer_package
  COMMAND "${CMAKE_COMMAND}"
    "-DRD_BUILD_DIR=${PROJECT_BINARY_DIR}"
    "-DRD_CONSUMER_SOURCE_DIR=${CMAKE_CURRENT_LIST_DIR}"
    "-DRD_WORK_DIR=${RD_CONSUMER_WORK_DIR}"
    "-DRD_CONFIG=$<CONFIG>"
    "-DRD_GENERATOR=${CMAKE_GENERATOR}"
    "-DRD_MAKE_PROGRAM=${CMAKE_MAKE_PROGRAM}"
    "-DRD_CXX_COMPILER=${CMAKE_CXX_COMPILER}"
    "-DRD_CXX_FLAGS=${RD_CONSUMER_CXX_FLAGS}"
    "-DRD_DEPS_CHECK=${RD_CONSUMER_DEPS_CHECK}"
    -P "${CMAKE_CURRENT_LIST_DIR}/run_consumer.cmake")
set_tests_properties(consumer_package PROPERTIES
  LABELS "cpu;install"
  TIMEOUT 900)
