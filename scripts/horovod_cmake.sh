#!/usr/bin/env bash
# cmake wrapper for building Horovod 0.28.1 against torch 2.x headers.
# Horovod forces C++14, torch >= 2.1 needs C++17. Horovod's setup.py runs the program named by
# HOROVOD_CMAKE; we inject a project include that maps CMake's C++11/14 flags to C++17.
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ "${1:-}" = "--build" ]; then exec cmake "$@"; fi
exec cmake -DCMAKE_PROJECT_INCLUDE="$here/horovod_cxx17.cmake" "$@"
