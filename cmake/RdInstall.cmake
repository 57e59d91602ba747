# Install rules and the CMake package config (completed by the install work item).
