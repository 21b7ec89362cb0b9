# Finds what zerort builds against. Required: Python (the project's venv), LibTorch from that
# Python. Optional: MPI, CUDA (+ NCCL), GoogleTest (tests), pybind11 (Python module).

find_package(Threads REQUIRED)
find_package(Python3 COMPONENTS Interpreter Development.Module REQUIRED)

# LibTorch comes from the project's Python, never from a separate download.
execute_process(
  COMMAND ${Python3_EXECUTABLE} -c "import torch.utils; print(torch.utils.cmake_prefix_path)"
  OUTPUT_VARIABLE ZERORT_TORCH_PREFIX OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE torch_rc)
if(NOT torch_rc EQUAL 0)
  message(FATAL_ERROR "zerort: ${Python3_EXECUTABLE} cannot import torch; run 'make venv' "
                      "(pip install torch==2.13.0) or pass -DPython3_EXECUTABLE=<python with torch>")
endif()
list(APPEND CMAKE_PREFIX_PATH ${ZERORT_TORCH_PREFIX})
find_package(Torch REQUIRED)
message(STATUS "zerort: LibTorch ${Torch_VERSION} from ${ZERORT_TORCH_PREFIX}")

find_package(MPI COMPONENTS C)
if(MPI_C_FOUND)
  set(ZERORT_WITH_MPI 1)
  message(STATUS "zerort: MPI found (${MPI_C_LIBRARIES}); building the mpi backend")
else()
  set(ZERORT_WITH_MPI 0)
  message(STATUS "zerort: MPI not found; the mpi backend is skipped")
endif()

include(CheckLanguage)
if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
  set(CMAKE_CUDA_ARCHITECTURES 80 90)  # A100, H100/H200; nvcc 13 dropped pre-Turing targets
endif()
# The shared CUDA runtime: the one PyTorch loads, so streams and events are shared with it.
set(CMAKE_CUDA_RUNTIME_LIBRARY Shared)
check_language(CUDA)
if(CMAKE_CUDA_COMPILER)
  enable_language(CUDA)
  find_package(CUDAToolkit REQUIRED)
  set(CMAKE_CUDA_STANDARD 17)
  set(ZERORT_WITH_CUDA 1)
  message(STATUS "zerort: nvcc found (${CMAKE_CUDA_COMPILER}, CUDA ${CUDAToolkit_VERSION}); "
                 "building the CUDA target for sm ${CMAKE_CUDA_ARCHITECTURES}")
else()
  set(ZERORT_WITH_CUDA 0)
  message(STATUS "zerort: nvcc not found; the CUDA target is skipped")
endif()

# NCCL is built whenever CUDA is. It comes from NCCL_HOME, the CUDA toolkit, or the
# nvidia-nccl-cu13 wheel in the project's Python (make venv installs it when nvcc exists).
set(ZERORT_WITH_NCCL 0)
if(ZERORT_WITH_CUDA)
  execute_process(
    COMMAND ${Python3_EXECUTABLE} -c "import nvidia.nccl as n; print(list(n.__path__)[0])"
    OUTPUT_VARIABLE zerort_nccl_wheel OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  # First match wins: NCCL_HOME, then the wheel (the NCCL PyTorch loads), then the toolkit.
  foreach(dir $ENV{NCCL_HOME} ${zerort_nccl_wheel})
    find_path(ZERORT_NCCL_INCLUDE_DIR nccl.h PATHS ${dir}/include NO_DEFAULT_PATH)
    find_library(ZERORT_NCCL_LIBRARY NAMES libnccl.so.2 nccl PATHS ${dir}/lib NO_DEFAULT_PATH)
  endforeach()
  find_path(ZERORT_NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
  find_library(ZERORT_NCCL_LIBRARY NAMES nccl libnccl.so.2 HINTS ${CUDAToolkit_LIBRARY_DIR})
  if(NOT ZERORT_NCCL_INCLUDE_DIR OR NOT ZERORT_NCCL_LIBRARY)
    message(FATAL_ERROR "zerort: nvcc was found, so the NCCL communicator is built, but NCCL "
                        "was not: pip install nvidia-nccl-cu13 into ${Python3_EXECUTABLE}'s "
                        "environment (make venv does), or set NCCL_HOME")
  endif()
  set(ZERORT_WITH_NCCL 1)
  message(STATUS "zerort: NCCL ${ZERORT_NCCL_LIBRARY} (headers ${ZERORT_NCCL_INCLUDE_DIR})")
endif()

if(ZERORT_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()

if(ZERORT_BUILD_PYTHON)
  # pybind11 builds with CMake's FindPython when a package (PyTorch's config) loaded it.
  set(Python_EXECUTABLE ${Python3_EXECUTABLE})
  find_package(Python COMPONENTS Interpreter Development.Module REQUIRED)
  execute_process(COMMAND ${Python3_EXECUTABLE} -m pybind11 --cmakedir
                  OUTPUT_VARIABLE pybind11_DIR OUTPUT_STRIP_TRAILING_WHITESPACE)
  find_package(pybind11 CONFIG REQUIRED)
endif()
