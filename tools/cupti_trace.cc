// A kernel tracer for machines without Nsight: loaded into any CUDA program through
// CUDA_INJECTION64_PATH, it records every kernel, memcpy and memset with CUPTI and writes
// them as CSV at exit, for tools/kernel_profile.py to break a training step down.
//
//   CUDA_INJECTION64_PATH=librd_cupti_trace.so RD_CUPTI_TRACE=trace.csv rd_train ...
//
// Under rd_launch (RANK and WORLD_SIZE > 1 set) rank r writes trace.csv.rank<r>.
//
// The CSV has one row per GPU activity: kind, start and end (ns, GPU clock), stream id,
// bytes (copies and sets; 0 for kernels), and the (demangled) kernel name last, quoted.
// With RD_CUPTI_API=1 the host's runtime and driver API calls are rows too (kinds runtime
// and driver, named by their functions), on the same clock.
#include <cupti.h>
#include <cxxabi.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

namespace {

constexpr size_t kBufferBytes = 8u << 20;
constexpr size_t kBufferAlign = 8;

struct Row {
  const char* kind;
  uint64_t start, end;
  uint32_t stream;
  uint64_t bytes;
  std::string name;
};

// The tracer's rows live from InitializeInjection until the atexit handler writes them;
// CUPTI calls back on its own thread, hence the lock.
struct TraceState {
  std::mutex mu;
  std::vector<Row> rows;
  std::string path;
};

TraceState& state() {
  static TraceState* s = new TraceState;  // leaked on purpose: used from an atexit handler
  return *s;
}

void report(CUptiResult r, const char* what) {
  if (r == CUPTI_SUCCESS) return;
  const char* message = nullptr;
  cuptiGetResultString(r, &message);
  std::fprintf(stderr, "rd_cupti_trace: %s failed: %s\n", what, message ? message : "?");
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(kBufferAlign, kBufferBytes));
  *size = kBufferBytes;
  *max_records = 0;  // as many as fit
}

// CUPTI names kernels by their mangled symbols; templates read better demangled.
std::string demangled(const char* name) {
  if (!name) return "?";
  int status = 0;
  char* plain = abi::__cxa_demangle(name, nullptr, nullptr, &status);
  std::string out = (status == 0 && plain) ? plain : name;
  std::free(plain);
  return out;
}

// Kernel records are read as CUpti_ActivityKernel10, the layout of the CUPTI 13 this
// file is compiled against (CUPTI hands out records in the layout its headers declare).
void add_record(const CUpti_Activity* record, std::vector<Row>& rows) {
  switch (record->kind) {
    case CUPTI_ACTIVITY_KIND_KERNEL:
    case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
      const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
      rows.push_back({"kernel", k->start, k->end, k->streamId, 0, demangled(k->name)});
      break;
    }
    case CUPTI_ACTIVITY_KIND_MEMCPY: {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(record);
      rows.push_back({"memcpy", m->start, m->end, m->streamId, m->bytes,
                      "memcpy kind " + std::to_string(m->copyKind)});
      break;
    }
    case CUPTI_ACTIVITY_KIND_RUNTIME:
    case CUPTI_ACTIVITY_KIND_DRIVER: {
      const auto* a = reinterpret_cast<const CUpti_ActivityAPI*>(record);
      const bool runtime = record->kind == CUPTI_ACTIVITY_KIND_RUNTIME;
      const char* name = nullptr;
      cuptiGetCallbackName(runtime ? CUPTI_CB_DOMAIN_RUNTIME_API : CUPTI_CB_DOMAIN_DRIVER_API,
                           a->cbid, &name);
      rows.push_back({runtime ? "runtime" : "driver", a->start, a->end, 0, 0, name ? name : "?"});
      break;
    }
    case CUPTI_ACTIVITY_KIND_MEMSET: {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(record);
      rows.push_back({"memset", m->start, m->end, m->streamId, m->bytes, "memset"});
      break;
    }
    default:
      break;
  }
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  std::vector<Row> rows;
  CUpti_Activity* record = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    add_record(record, rows);
  }
  std::free(buffer);
  TraceState& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  for (Row& row : rows) s.rows.push_back(std::move(row));
}

std::string csv_quoted(const std::string& text) {
  std::string out = "\"";
  for (char c : text) out += (c == '"') ? std::string("\"\"") : std::string(1, c);
  return out + "\"";
}

// Writes to a temporary name and renames, so a reader never sees half a trace.
void write_trace() {
  report(cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED), "cuptiActivityFlushAll");
  TraceState& s = state();
  std::lock_guard<std::mutex> lock(s.mu);
  const std::string temporary = s.path + ".tmp";
  FILE* f = std::fopen(temporary.c_str(), "w");
  if (!f) {
    std::fprintf(stderr, "rd_cupti_trace: cannot write %s\n", temporary.c_str());
    return;
  }
  std::fprintf(f, "kind,start_ns,end_ns,stream,bytes,name\n");
  for (const Row& r : s.rows) {
    std::fprintf(f, "%s,%llu,%llu,%u,%llu,%s\n", r.kind, static_cast<unsigned long long>(r.start),
                 static_cast<unsigned long long>(r.end), r.stream,
                 static_cast<unsigned long long>(r.bytes), csv_quoted(r.name).c_str());
  }
  const bool ok = std::fclose(f) == 0 && std::rename(temporary.c_str(), s.path.c_str()) == 0;
  std::fprintf(stderr, "rd_cupti_trace: %s %zu activities to %s\n", ok ? "wrote" : "FAILED writing",
               s.rows.size(), s.path.c_str());
}

}  // namespace

// Called by the CUDA driver when it initializes, for the library named by
// CUDA_INJECTION64_PATH. Returns 1 on success, as the driver expects.
extern "C" int InitializeInjection(void) {
  const char* path = std::getenv("RD_CUPTI_TRACE");
  state().path = (path && *path) ? path : "cupti_trace.csv";
  // Ranks that rd_launch started share the variable: each writes its own file.
  const char* rank = std::getenv("RANK");
  const char* world = std::getenv("WORLD_SIZE");
  if (rank != nullptr && world != nullptr && std::string(world) != "1") {
    state().path += std::string(".rank") + rank;
  }
  report(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed),
         "cuptiActivityRegisterCallbacks");
  report(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "enable kernels");
  report(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY), "enable memcpy");
  report(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET), "enable memset");
  // RD_CUPTI_API=1: the host's CUDA runtime and driver calls too (kinds "runtime" and
  // "driver", stream 0), to see what the host does while the GPU waits on it.
  const char* api = std::getenv("RD_CUPTI_API");
  if (api != nullptr && std::string(api) == "1") {
    report(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_RUNTIME), "enable runtime API");
    report(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_DRIVER), "enable driver API");
  }
  std::atexit(write_trace);
  return 1;
}
