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
# The NCCL communicator is not written yet (issue 7); config.h says so until it is.
set(ZERORT_WITH_NCCL 0)

if(ZERORT_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()

if(ZERORT_BUILD_PYTHON)
  execute_process(COMMAND ${Python3_EXECUTABLE} -m pybind11 --cmakedir
                  OUTPUT_VARIABLE pybind11_DIR OUTPUT_STRIP_TRAILING_WHITESPACE)
  find_package(pybind11 CONFIG REQUIRED)
endif()
