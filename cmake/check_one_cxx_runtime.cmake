# Run after _C is linked (cmake -DNM=... -DMODULE=... -P this file): fails the build when the
# module defines libstdc++'s locale machinery (std::locale::id::_M_id), i.e. carries its own
# copy of the C++ runtime. Such a module crashes on its first formatted error message, because
# torch's copy of the runtime set up the locale it then reads (see CMakeLists.txt).
execute_process(COMMAND "${NM}" --defined-only "${MODULE}"
                OUTPUT_VARIABLE _symbols RESULT_VARIABLE _status ERROR_QUIET)
if(NOT _status EQUAL 0)
  message(WARNING "ampfuse: could not list the symbols of ${MODULE} with ${NM}; "
                  "skipping the one-C++-runtime check.")
  return()
endif()
string(FIND "${_symbols}" "_ZNKSt6locale2id5_M_idEv" _at)
if(NOT _at EQUAL -1)
  message(FATAL_ERROR "ampfuse: ${MODULE} contains a private copy of libstdc++ (it defines "
                      "std::locale::id::_M_id): the C++ compiler linked its static libstdc++. "
                      "Build with a compiler that has a shared libstdc++ (e.g. CXX=/usr/bin/g++) "
                      "and rebuild from scratch (rm -rf build).")
endif()
