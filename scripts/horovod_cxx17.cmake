# Included after every project() of Horovod's build (see horovod_cmake.sh): C++14/11 requests become C++17.
set(CMAKE_CXX14_STANDARD_COMPILE_OPTION "-std=c++17")
set(CMAKE_CXX14_EXTENSION_COMPILE_OPTION "-std=gnu++17")
set(CMAKE_CXX11_STANDARD_COMPILE_OPTION "-std=c++17")
set(CMAKE_CXX11_EXTENSION_COMPILE_OPTION "-std=gnu++17")
