# One libstdc++ per process. zerort._C and the C++ tests run beside LibTorch, which uses the
# shared libstdc++.so.6. A compiler that links libstdc++ statically into shared objects (a
# -static-libstdc++ in its specs or in a wrapper script: some clusters' module GCC, conda
# toolchains, the H200 machine's /opt/gcc) gives _C its own copy beside LibTorch's, and then
# std::ostringstream misbehaves: numbers vanish from messages on some machines ("got " for
# "got 0"), and on others formatting any message segfaults.
#
# At configure time this module builds a tiny shared object that uses std::ostringstream with
# the C++ compiler (and with nvcc and its host compiler when CUDA is on) and reads its NEEDED
# entries (readelf -d) and its defined symbols (nm -D). If libstdc++ was linked statically:
#   ZERORT_SHARE_LIBSTDCXX=ON (default): every link of the project puts the compiler's own
#     libstdc++.so first (--no-as-needed), so the driver's static libstdc++.a, which comes
#     last, has nothing left to supply. The fix is applied only if the probe built with it is
#     verified to share libstdc++; otherwise the configure stops.
#   ZERORT_SHARE_LIBSTDCXX=OFF: the configure stops, naming the compiler and what to set.
# zerort_check_shares_libstdcxx(target) adds the same check to a built shared object after
# each link, so a module with its own copy can never be produced silently.
#
# Run as a script (cmake -DZERORT_CHECK_FILE=<so> -P ZerortLibstdcxx.cmake), it checks one
# built file and fails if it carries its own libstdc++.

# Symbols that only libstdc++ itself defines (never instantiated from headers): a shared
# object that defines them has its own copy. std::locale::classic(), std::ios_base::Init::Init().
set(_ZERORT_LIBSTDCXX_SENTINELS _ZNSt6locale7classicEv _ZNSt8ios_base4InitC1Ev)

# Sets out_var to "" when `file` shares libstdc++ (libstdc++.so in NEEDED, none of the
# sentinels defined), else to a sentence saying what is wrong with it.
function(_zerort_libstdcxx_verdict file out_var)
  execute_process(COMMAND "${ZERORT_READELF}" -d "${file}" OUTPUT_VARIABLE dyn RESULT_VARIABLE rc ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    set(${out_var} "readelf -d ${file} failed: ${err}" PARENT_SCOPE)
    return()
  endif()
  execute_process(COMMAND "${ZERORT_NM}" -D --defined-only "${file}" OUTPUT_VARIABLE syms RESULT_VARIABLE rc
                  ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    set(${out_var} "nm -D ${file} failed: ${err}" PARENT_SCOPE)
    return()
  endif()
  set(own "")
  foreach(s IN LISTS _ZERORT_LIBSTDCXX_SENTINELS)
    if(syms MATCHES " ${s}(\n|@|$)")
      list(APPEND own ${s})
    endif()
  endforeach()
  set(verdict "")
  if(NOT dyn MATCHES "\\(NEEDED\\)[^\n]*\\[libstdc\\+\\+\\.so")
    string(APPEND verdict "it has no libstdc++.so among its NEEDED entries (readelf -d)")
  endif()
  if(own)
    if(verdict)
      string(APPEND verdict " and ")
    else()
      string(APPEND verdict "it ")
    endif()
    list(JOIN own ", " own)
    string(APPEND verdict "defines libstdc++'s own symbols itself (${own})")
  endif()
  if(verdict)
    string(APPEND verdict ": libstdc++ was linked into it statically")
  endif()
  set(${out_var} "${verdict}" PARENT_SCOPE)
endfunction()

function(_zerort_find_binutils)
  foreach(tool READELF NM)
    string(TOLOWER ${tool} name)
    if(NOT ZERORT_${tool})
      if(CMAKE_${tool})
        set(ZERORT_${tool} "${CMAKE_${tool}}" PARENT_SCOPE)
        set(ZERORT_${tool} "${CMAKE_${tool}}")
      else()
        find_program(ZERORT_${tool} ${name})
      endif()
    endif()
    if(NOT ZERORT_${tool})
      message(FATAL_ERROR "zerort: ${name} (binutils) is needed to check how the compiler links libstdc++; "
                          "install binutils or set -DZERORT_${tool}=<path>")
    endif()
  endforeach()
endfunction()

if(CMAKE_SCRIPT_MODE_FILE)  # cmake -DZERORT_CHECK_FILE=... -P ZerortLibstdcxx.cmake
  _zerort_find_binutils()
  _zerort_libstdcxx_verdict("${ZERORT_CHECK_FILE}" verdict)
  if(verdict)
    message(FATAL_ERROR "zerort: ${ZERORT_CHECK_FILE}: ${verdict}. It would run with its own libstdc++ beside "
                        "LibTorch's, and std::ostringstream then drops numbers from messages or crashes. "
                        "Reconfigure with a compiler that links libstdc++ dynamically, e.g. "
                        "CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++ in a fresh build directory.")
  endif()
  return()
endif()

option(ZERORT_SHARE_LIBSTDCXX
       "When the compiler links libstdc++ statically, link its shared libstdc++.so instead (OFF: stop the configure)"
       ON)
_zerort_find_binutils()

set(_zerort_probe_dir "${CMAKE_BINARY_DIR}/CMakeFiles/zerort_libstdcxx_probe")
file(MAKE_DIRECTORY "${_zerort_probe_dir}")
file(WRITE "${_zerort_probe_dir}/probe.cpp"
     "#include <sstream>\n#include <string>\n"
     "std::string zerort_probe(int n) { std::ostringstream os; os << \"got \" << n; return os.str(); }\n")

# Builds the probe with one compiler. kind: cxx or cuda; extra: link arguments (the fix).
# Sets out_var to the verdict ("" = shares libstdc++), or to why the probe did not build.
function(_zerort_libstdcxx_probe kind name out_var)
  set(so "${_zerort_probe_dir}/${kind}_${name}.so")
  file(REMOVE "${so}")
  if(kind STREQUAL "cxx")
    separate_arguments(flags UNIX_COMMAND "${CMAKE_CXX_FLAGS}")
    set(cmd "${CMAKE_CXX_COMPILER}" ${flags} -shared -fPIC ${ARGN} -o "${so}" "${_zerort_probe_dir}/probe.cpp")
  else()
    set(cmd "${CMAKE_CUDA_COMPILER}")
    if(CMAKE_CUDA_HOST_COMPILER)
      list(APPEND cmd -ccbin "${CMAKE_CUDA_HOST_COMPILER}")
    endif()
    list(APPEND cmd -shared -Xcompiler -fPIC ${ARGN} -o "${so}" "${_zerort_probe_dir}/probe.cpp")
  endif()
  execute_process(COMMAND ${cmd} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    list(JOIN cmd " " cmd)
    set(${out_var} "the probe did not build (${cmd}): ${out}" PARENT_SCOPE)
    return()
  endif()
  _zerort_libstdcxx_verdict("${so}" verdict)
  set(${out_var} "${verdict}" PARENT_SCOPE)
endfunction()

set(_zerort_static "")  # "what: verdict" for each compiler that links libstdc++ statically
_zerort_libstdcxx_probe(cxx plain cxx_verdict)
if(cxx_verdict)
  list(APPEND _zerort_static "C++ compiler ${CMAKE_CXX_COMPILER}: a shared object it builds with std::ostringstream: ${cxx_verdict}")
endif()
if(CMAKE_CUDA_COMPILER)
  _zerort_libstdcxx_probe(cuda plain cuda_verdict)
  if(cuda_verdict)
    set(host "${CMAKE_CUDA_HOST_COMPILER}")
    if(NOT host)
      set(host "nvcc's default host compiler")
    endif()
    list(APPEND _zerort_static "CUDA host compiler ${host} (through ${CMAKE_CUDA_COMPILER}): a shared object it builds with std::ostringstream: ${cuda_verdict}")
  endif()
endif()

if(NOT _zerort_static)
  message(STATUS "zerort: ${CMAKE_CXX_COMPILER} links libstdc++ dynamically (libstdc++.so in a probe's NEEDED)")
else()
  list(JOIN _zerort_static "; " _zerort_why)
  string(CONCAT _zerort_advice
         "_C and the tests would carry their own libstdc++ beside the shared one LibTorch loads, and "
         "std::ostringstream then drops numbers from messages or segfaults. Use a compiler that links libstdc++ "
         "dynamically, in a fresh build directory, e.g. CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++ "
         "(or -DCMAKE_CXX_COMPILER=/usr/bin/g++ -DCMAKE_CUDA_HOST_COMPILER=/usr/bin/g++)")
  if(NOT ZERORT_SHARE_LIBSTDCXX)
    message(FATAL_ERROR "zerort: ${_zerort_why}. ${_zerort_advice}. (ZERORT_SHARE_LIBSTDCXX=OFF: the "
                        "configure stops instead of linking the shared libstdc++.so.)")
  endif()
  # The fix: the compiler's own shared libstdc++, first on every link line and kept there.
  execute_process(COMMAND "${CMAKE_CXX_COMPILER}" -print-file-name=libstdc++.so OUTPUT_VARIABLE _zerort_libstdcxx_so
                  OUTPUT_STRIP_TRAILING_WHITESPACE)
  set(_zerort_fix_failed "")
  if(NOT IS_ABSOLUTE "${_zerort_libstdcxx_so}" OR NOT EXISTS "${_zerort_libstdcxx_so}")
    string(CONCAT _zerort_fix_failed "${CMAKE_CXX_COMPILER} -print-file-name=libstdc++.so names no file "
           "('${_zerort_libstdcxx_so}'): it has no shared libstdc++ to link instead")
  elseif(_zerort_libstdcxx_so MATCHES ",")
    set(_zerort_fix_failed "the path of its libstdc++.so (${_zerort_libstdcxx_so}) has a comma")
  else()
    set(_zerort_fix "--push-state,--no-as-needed,${_zerort_libstdcxx_so},--pop-state")
    _zerort_libstdcxx_probe(cxx fixed v "-Wl,${_zerort_fix}")
    if(v)
      string(APPEND _zerort_fix_failed "linked with -Wl,${_zerort_fix} the C++ compiler's probe still fails: ${v}")
    endif()
    if(CMAKE_CUDA_COMPILER)
      _zerort_libstdcxx_probe(cuda fixed v -Xlinker "${_zerort_fix}")
      if(v)
        string(APPEND _zerort_fix_failed " linked with -Xlinker ${_zerort_fix} the nvcc probe still fails: ${v}")
      endif()
    endif()
  endif()
  if(_zerort_fix_failed)
    message(FATAL_ERROR "zerort: ${_zerort_why}. Linking the shared libstdc++ instead did not work: "
                        "${_zerort_fix_failed}. ${_zerort_advice}.")
  endif()
  add_link_options("LINKER:${_zerort_fix}")
  message(WARNING "zerort: ${_zerort_why}. Every link of this build therefore names ${_zerort_libstdcxx_so} "
                  "first (--no-as-needed), so libstdc++ is shared with LibTorch; a probe built that way was "
                  "checked (libstdc++.so in NEEDED, no copy of its symbols). To avoid this, use a compiler that "
                  "links libstdc++ dynamically, e.g. CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++.")
endif()

# After each link of `target` (a shared object), fail the build if it carries its own libstdc++.
function(zerort_check_shares_libstdcxx target)
  add_custom_command(
    TARGET ${target} POST_BUILD
    COMMAND "${CMAKE_COMMAND}" "-DZERORT_CHECK_FILE=$<TARGET_FILE:${target}>" "-DZERORT_READELF=${ZERORT_READELF}"
            "-DZERORT_NM=${ZERORT_NM}" -P "${CMAKE_CURRENT_FUNCTION_LIST_FILE}"
    VERBATIM)
endfunction()
