// The interpreter lock around a kernel's loops (issue 46). A kernel is entered two ways: from its Python binding,
// holding the lock (which it releases while it computes, so other Python threads run), and as a torch operator
// (ops.cpp), which torch's Python entry has already released. ReleaseGil releases it only where it is held.

#pragma once

#include <Python.h>

namespace moe_gil {
namespace {

class ReleaseGil {
 public:
  ReleaseGil() : state_(PyGILState_Check() ? PyEval_SaveThread() : nullptr) {}
  ~ReleaseGil() {
    if (state_) PyEval_RestoreThread(state_);
  }
  ReleaseGil(const ReleaseGil&) = delete;
  ReleaseGil& operator=(const ReleaseGil&) = delete;

 private:
  PyThreadState* state_;
};

}  // namespace
}  // namespace moe_gil
