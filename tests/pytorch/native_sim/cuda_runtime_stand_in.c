/* A stand-in for the few CUDA runtime calls that c10 and the native back end make on the paths
 * tests/pytorch/test_native_sim.py drives: one device, nothing ever captured, no work to wait
 * for. Preloaded (LD_PRELOAD) over the real libcudart, which cannot answer without a GPU; the
 * allocations themselves go to allocwatch's simulated device (ALLOCWATCH_TORCH_DEVICE=sim). */
#include <stddef.h>

int cudaGetDevice(int* device) { *device = 0; return 0; }
int cudaSetDevice(int device) { (void)device; return 0; }
int cudaGetDeviceCount(int* count) { *count = 1; return 0; }
int cudaGetLastError(void) { return 0; }
int cudaPeekAtLastError(void) { return 0; }
int cudaDeviceGetStreamPriorityRange(int* least, int* greatest) {
  if (least) *least = 0;
  if (greatest) *greatest = -1;
  return 0;
}
int cudaStreamIsCapturing(void* stream, int* status) { (void)stream; *status = 0; return 0; }
int cudaThreadExchangeStreamCaptureMode(int* mode) { (void)mode; return 0; }
int cudaDriverGetVersion(int* version) { *version = 13000; return 0; }
int cudaRuntimeGetVersion(int* version) { *version = 13000; return 0; }
int cudaDeviceSynchronize(void) { return 0; }
int cudaStreamSynchronize(void* stream) { (void)stream; return 0; }

/* A scripted stream capture, for the reuse of blocks during a capture: streams are whatever
 * cudaStream_t values the scenario makes up, told apart by their bits 16 and up (c10 keeps
 * small values for its own stream ids); nodes are numbers. stand_in_node() adds work after a
 * stream's current terminals; stand_in_wait() is cudaStreamWaitEvent's join. */
enum { kStreams = 16, kNodes = 1024, kFanIn = 16 };
static int g_capture[kStreams];
static unsigned long long g_capture_id[kStreams];
static void* g_terminals[kStreams][kFanIn];
static size_t g_terminal_count[kStreams];
static void* g_parents[kNodes][kFanIn];
static size_t g_parent_count[kNodes];
static size_t g_nodes;

static size_t slot(const void* stream) { return ((size_t)stream >> 16) % kStreams; }

void stand_in_capture_begin(long stream, unsigned long long id) {
  g_capture[slot((void*)stream)] = 1;
  g_capture_id[slot((void*)stream)] = id;
  g_terminal_count[slot((void*)stream)] = 0;
}

void stand_in_capture_end(long stream) { g_capture[slot((void*)stream)] = 0; }

long stand_in_node(long stream) {
  const size_t s = slot((void*)stream), node = ++g_nodes;
  for (size_t i = 0; i < g_terminal_count[s]; ++i) g_parents[node][i] = g_terminals[s][i];
  g_parent_count[node] = g_terminal_count[s];
  g_terminals[s][0] = (void*)node;
  g_terminal_count[s] = 1;
  return (long)node;
}

void stand_in_wait(long waiter, long other) {
  const size_t w = slot((void*)waiter), o = slot((void*)other);
  for (size_t i = 0; i < g_terminal_count[o]; ++i) {
    int known = 0;
    for (size_t j = 0; j < g_terminal_count[w]; ++j) known |= g_terminals[w][j] == g_terminals[o][i];
    if (!known) g_terminals[w][g_terminal_count[w]++] = g_terminals[o][i];
  }
  if (!g_capture[w] && g_capture[o]) {
    g_capture[w] = 1;
    g_capture_id[w] = g_capture_id[o];
  }
}

int cudaStreamGetCaptureInfo(void* stream, int* status, unsigned long long* id, void** graph,
                             void* const** dependencies, const void** edges, size_t* count) {
  const size_t s = slot(stream);
  *status = g_capture[s] ? 1 /* cudaStreamCaptureStatusActive */ : 0;
  if (id) *id = g_capture_id[s];
  if (graph) *graph = g_capture[s] ? (void*)&g_capture_id[s] : NULL;
  if (dependencies) *dependencies = g_terminals[s];
  if (edges) *edges = NULL;
  if (count) *count = g_capture[s] ? g_terminal_count[s] : 0;
  return 0;
}

int cudaGraphNodeGetDependencies(void* node, void** out, void* edges, size_t* count) {
  (void)edges;
  const size_t n = (size_t)node;
  if (out == NULL) {
    *count = g_parent_count[n];
    return 0;
  }
  const size_t give = *count < g_parent_count[n] ? *count : g_parent_count[n];
  for (size_t i = 0; i < give; ++i) out[i] = g_parents[n][i];
  *count = give;
  return 0;
}
