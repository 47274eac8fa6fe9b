// Python binding of the core: allocator_ext._core.
//
// Pointers cross into Python as integers. C++ errors become Python ones: a bad setting is a
// ValueError naming it, an out-of-memory error is allocator_ext.OutOfMemoryError (a
// MemoryError), misuse (freeing an unknown pointer) is a ValueError.
#include <pybind11/functional.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <cmath>
#include <iterator>
#include <memory>

#include "devices/sim_device.h"
#include "core/allocator.h"
#include "core/config.h"
#include "core/history.h"
#include "core/sizes.h"
#include "torch_allocators.h"

namespace py = pybind11;
using namespace allocwatch;

namespace {

AllocatorConfig config_from(const std::optional<std::string>& text) {
  AllocatorConfig base = AllocatorConfig::allocwatch();
  return text ? apply_config(base, *text) : base;
}

// Each setting's value as Python has it: sizes in bytes (-1: unlimited), the roundup
// divisions as {interval start in MiB: divisions}.
py::object python_value(const SettingInfo&, bool v) { return py::bool_(v); }
py::object python_value(const SettingInfo& s, std::size_t v) {
  return s.range.unlimited && v == kNoMaxSplit ? py::int_(-1) : py::int_(v);
}
py::object python_value(const SettingInfo&, double v) { return py::float_(v); }
py::object python_value(const SettingInfo&, const RoundupDivisions& v) {
  py::dict divisions;
  for (std::size_t i = 0; i < kRoundupIntervals; ++i)
    divisions[py::str(std::to_string(std::size_t{1} << i))] = v[i];
  return std::move(divisions);
}
py::object python_value(const SettingInfo&, AllocatorBackend) { return py::str("native"); }

// Every setting under its member's name (settings_table.h), and "string": the settings string.
py::dict config_dict(const AllocatorConfig& c) {
  py::dict d;
  std::size_t row = 0;
#define ALLOCWATCH_PY_VALUE(Type, field, ...) d[#field] = python_value(kSettings[row++], c.field);
  ALLOCWATCH_SETTINGS(ALLOCWATCH_PY_VALUE)
#undef ALLOCWATCH_PY_VALUE
  d["string"] = c.to_string();
  return d;
}

// What kind of value a setting takes, by its type, for the binding's table.
const char* value_kind(const bool*) { return "bool"; }
const char* value_kind(const std::size_t*) { return "whole"; }
const char* value_kind(const double*) { return "real"; }
const char* value_kind(const RoundupDivisions*) { return "divisions"; }
const char* value_kind(const AllocatorBackend*) { return "choice"; }

// The settings table (settings_table.h), one dict a row: its values in words and as a range
// (what tests generate values from), and each default as a settings string writes it.
py::tuple settings_table() {
  const auto native = AllocatorConfig::native().items();
  const auto ours = AllocatorConfig::allocwatch().items();
  py::list rows;
  std::size_t i = 0;
  auto add = [&](const char* kind) {
    const SettingInfo& s = kSettings[i];
    const ValueRange& r = s.range;
    py::dict range;
    range["kind"] = kind;
    range["unit"] = r.in_mebibytes ? "MiB" : "";
    range["min"] = r.min;
    range["max"] = r.max == 0 ? py::object(py::none()) : py::object(py::int_(r.max));
    range["multiple"] = r.multiple;
    range["power_of_two"] = r.power_of_two;
    range["zero"] = r.zero;
    range["above"] = r.above;
    range["below"] = r.below;
    py::dict row;
    row["key"] = s.key;
    row["name"] = s.field;
    row["values"] = describe_values(s);
    row["range"] = range;
    row["native_default"] = native[i].second;
    row["default"] = ours[i].second;
    row["origin"] = s.origin == SettingOrigin::pytorch ? "pytorch" : "allocwatch";
    row["on_pytorch_call"] = s.on_pytorch_call == OnPytorchCall::resets ? "resets" : "keeps";
    row["help"] = s.help;
    rows.append(row);
    ++i;
  };
#define ALLOCWATCH_TABLE_ROW(Type, ...) add(value_kind(static_cast<const Type*>(nullptr)));
  ALLOCWATCH_SETTINGS(ALLOCWATCH_TABLE_ROW)
#undef ALLOCWATCH_TABLE_ROW
  return py::tuple(rows);
}

// A Python object as the opaque context of trace entries (history.h), for tests of the
// history: it is released with the GIL held, whichever thread drops the last reference.
const char kPyTraceContextTag = 0;
struct PyTraceContext : TraceContext {
  PyTraceContext() : TraceContext(&kPyTraceContextTag) {}
  py::object value;
  ~PyTraceContext() {
    py::gil_scoped_acquire gil;
    value = py::object();
  }
};

ContextHandle context_from(const py::object& value) {
  if (value.is_none()) return nullptr;
  auto context = std::make_shared<PyTraceContext>();
  context->value = value;
  return context;
}

py::dict trace_entry_dict(const TraceEntry& e) {
  py::dict d;
  d["action"] = trace_action_name(e.action);
  d["addr"] = e.addr;
  d["size"] = e.size;
  d["stream"] = e.stream;
  d["time_us"] = e.time_us;
  d["compile_context"] = "N/A";
  d["user_metadata"] = "";
  d["frames"] = py::list();
  // Only contexts set from Python are shown; others (the native back end's) are opaque here.
  if (e.context && e.context->owner == &kPyTraceContextTag)
    d["context"] = static_cast<const PyTraceContext*>(e.context.get())->value;
  return d;
}

py::list segments_list(const std::vector<SegmentCheckpoint>& segments) {
  py::list out;
  for (const SegmentCheckpoint& s : segments) {
    py::dict seg;
    seg["address"] = s.address;
    seg["total_size"] = s.total_size;
    seg["stream"] = s.stream;
    seg["is_small"] = s.is_small;
    seg["is_expandable"] = s.is_expandable;
    py::list blocks;
    for (const BlockCheckpoint& b : s.blocks)
      blocks.append(py::make_tuple(b.ptr, b.size, b.requested_size, b.allocated));
    seg["blocks"] = blocks;
    out.append(seg);
  }
  return out;
}

std::uint32_t action_bits(const std::vector<std::string>& names) {
  std::uint32_t bits = 0;
  for (const std::string& name : names) {
    TraceAction a;
    if (!trace_action_from_name(name, &a))
      throw std::invalid_argument("allocwatch: unknown trace action " + name);
    bits |= trace_action_bit(a);
  }
  return bits;
}

// The fraction of `total` that set_memory_fraction (and PyTorch's) turns back into `limit` to
// the byte: their product truncated. The quotient can fall a byte short, so it is nudged up.
double fraction_for_limit(std::size_t limit, std::size_t total) {
  const double t = static_cast<double>(total);
  double f = static_cast<double>(limit) / t;
  while (static_cast<std::size_t>(f * t) < limit) f = std::nextafter(f, 1.0);
  return f;
}

// The memory fraction in force (None: none, or one at least the device) and the device's total
// (None: unknown), under the key allocwatch's recorders keep them (allocator_ext.replay.trace,
// RECORDING_KEY): PyTorch's snapshot keeps neither, and an out-of-memory error recorded under a
// fraction recurs in a replay only under the same cap.
py::dict recorded_limits(CachingAllocator& a) {
  std::size_t total = 0;
  try {
    total = a.device().memory_info().total;
  } catch (const std::exception&) {  // a device that cannot say: the snapshot keeps no cap
  }
  const std::size_t limit = a.memory_limit();
  py::dict recording;
  recording["device_total_bytes"] = total > 0 ? py::object(py::int_(total)) : py::none();
  recording["memory_fraction"] =
      limit > 0 && limit < total ? py::object(py::float_(fraction_for_limit(limit, total)))
                                 : py::none();
  return recording;
}

// The layout of torch.cuda.memory._snapshot(), which PyTorch's memory viewer reads.
py::dict snapshot_dict(CachingAllocator& a) {
  py::list segments;
  for (const SegmentInfo& s : a.snapshot()) {
    py::dict seg;
    seg["device"] = a.device().index();
    seg["address"] = s.address;
    seg["total_size"] = s.total_size;
    seg["allocated_size"] = s.allocated_size;
    seg["active_size"] = s.active_size;
    seg["requested_size"] = s.requested_size;
    seg["stream"] = s.stream;
    seg["segment_type"] = s.is_large ? "large" : "small";
    seg["segment_pool_id"] = py::make_tuple(s.pool_id.first, s.pool_id.second);
    seg["is_expandable"] = s.is_expandable;
    seg["registration_counter"] = s.registration_counter;
    seg["frames"] = py::list();
    py::list blocks;
    for (const BlockInfo& b : s.blocks) {
      py::dict blk;
      blk["address"] = b.address;
      blk["size"] = b.size;
      blk["requested_size"] = b.requested_size;
      blk["state"] = b.state;
      blk["frames"] = py::list();
      blocks.append(blk);
    }
    seg["blocks"] = blocks;
    segments.append(seg);
  }
  py::list trace;
  for (const TraceEntry& e : a.trace()) trace.append(trace_entry_dict(e));
  py::list device_traces;
  device_traces.append(trace);
  AllocatorConfig c = a.config();
  py::dict settings = config_dict(c);
  settings["PYTORCH_CUDA_ALLOC_CONF"] = c.to_string();
  py::dict snap;
  snap["segments"] = segments;
  snap["device_traces"] = device_traces;
  snap["allocator_settings"] = settings;
  snap["external_annotations"] = py::list();
  snap["allocwatch_recording"] = recorded_limits(a);
  return snap;
}

py::dict counters_dict(const SimDevice& d) {
  py::dict out;
  for (const auto& [name, c] : d.counters()) {
    py::dict entry;
    entry["count"] = c.count;
    entry["bytes"] = c.bytes;
    out[py::str(name)] = entry;
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() =
      "allocwatch's caching allocator core (C++17): Allocator, which follows PyTorch's "
      "CUDACachingAllocator rule for rule, on a SimDevice (a simulated GPU) or serving PyTorch "
      "(torch_allocator). Sizes and addresses are int bytes; streams are int ids (0: the "
      "default stream).";

  static py::exception<OutOfMemoryError> oom(m, "OutOfMemoryError", PyExc_MemoryError);
  oom.attr("__doc__") =
      "The device cannot hold a request even after freeing cached blocks. Attributes: "
      "requested, device_free, device_total, allocated, reserved (bytes).";
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const OutOfMemoryError& e) {
      py::object err = py::handle(oom.ptr())(e.what());
      err.attr("requested") = e.requested;
      err.attr("device_free") = e.device_free;
      err.attr("device_total") = e.device_total;
      err.attr("allocated") = e.allocated;
      err.attr("reserved") = e.reserved;
      PyErr_SetObject(oom.ptr(), err.ptr());
    } catch (const ConfigError& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const DeviceError& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });

  m.def("round_size", [](std::size_t size) { return round_size(size, RoundupDivisions{}); },
        py::arg("size"),
        "The size PyTorch's default settings round a request of `size` bytes to: a multiple "
        "of 512 B, at least 512 B.");
  m.def("fraction_for_limit", &fraction_for_limit, py::arg("limit"), py::arg("total"),
        "The memory fraction of a device of `total` bytes that caps reserved memory at `limit` "
        "bytes to the byte, as set_memory_fraction and PyTorch compute the cap (truncated).");
  m.def("segment_size_for", &segment_size_for, py::arg("size"),
        "The size of the segment (device allocation) made for a rounded request of `size` "
        "bytes: 2 MiB up to 1 MiB, 20 MiB below 10 MiB, else the request rounded up to 2 MiB.");
  m.def(
      "parse_config",
      [](const std::string& text, std::optional<std::string> base, bool pytorch_call) {
        const AllocatorConfig start = config_from(base);
        return config_dict(pytorch_call ? apply_pytorch_settings(start, text)
                                        : apply_config(start, text));
      },
      py::arg("text"), py::arg("base") = py::none(), py::arg("pytorch_call") = false,
      "Validates a settings string on top of `base` (allocwatch's defaults when None) and "
      "returns every setting; raises ValueError naming a bad key or value. pytorch_call: as "
      "torch.cuda.memory._set_allocator_settings takes it under the native back end (the "
      "settings SETTINGS marks 'resets' return to their defaults unless named).");
  m.def(
      "config_items",
      [](const std::string& text, std::optional<std::string> base) {
        return apply_config(config_from(base), text).items();
      },
      py::arg("text"), py::arg("base") = py::none(),
      "Every setting of `text` on top of `base` as (key, value), each value written as a "
      "settings string takes it back, in SETTINGS' order.");
  m.attr("SETTINGS") = settings_table();
  m.def(
      "known_settings",
      [](const std::string& text) {
        std::vector<std::pair<std::string, std::string>> others;
        std::string known = known_settings(text, &others);
        return py::make_tuple(known, others);
      },
      py::arg("text"),
      "Splits a PyTorch settings string into (the entries this allocator knows, as a settings "
      "string; the others as (key, value) pairs). Refuses only a space inside a word "
      "(ValueError naming the key); parse_config validates.");
  m.attr("NATIVE_CONFIG") = AllocatorConfig::native().to_string();
  m.attr("DEFAULT_CONFIG") = AllocatorConfig::allocwatch().to_string();

  py::class_<Device, std::shared_ptr<Device>>(
      m, "Device", "What the allocator asks of a GPU; SimDevice is the one made from Python.");

  py::class_<PoolCheckpoint>(m, "PoolCheckpoint",
                             "A private pool's layout, as Allocator.checkpoint_pool saved it.")
      .def_property_readonly("pool_id", [](const PoolCheckpoint& c) { return c.pool; })
      .def_property_readonly("segments",
                             [](const PoolCheckpoint& c) { return segments_list(c.segments); });

  py::class_<SimDevice, Device, std::shared_ptr<SimDevice>>(
      m, "SimDevice",
      "A simulated GPU: a capacity, an address space, streams whose events complete when the "
      "caller says (or at once, with set_auto_complete(True)), and a counter of every device "
      "call. What replay and the tests run the allocator on.")
      .def(py::init<std::size_t, int>(), py::arg("capacity") = 0, py::arg("index") = 0,
           "A simulated GPU with `capacity` bytes (0: unlimited).")
      .def_property("capacity", &SimDevice::capacity, &SimDevice::set_capacity,
                    "Device memory in bytes (0: unlimited); may be changed at any time.")
      .def_property_readonly("used", &SimDevice::used, "Bytes of device memory in use.")
      .def_property_readonly("outstanding_events", &SimDevice::outstanding_events,
                             "Events recorded and not yet completed.")
      .def("memory_info",
           [](SimDevice& d) {
             MemoryInfo i = d.memory_info();
             return py::make_tuple(i.free, i.total);
           },
           "(free, total) bytes, as cudaMemGetInfo reports them.")
      .def("plan_addresses", &SimDevice::plan_addresses, py::arg("plan"),
           "Addresses for the next segment allocations: a list of (size, address).")
      .def("complete_stream", &SimDevice::complete_stream, py::arg("stream"),
           "Complete every event recorded on `stream` so far.")
      .def("record_event", &SimDevice::record_event, py::arg("stream"),
           "An event marking the work queued on `stream` so far (as a kernel's caller would).")
      .def("query_event", &SimDevice::query_event, py::arg("event"),
           "Whether the event has completed.")
      .def("stream_idle", &SimDevice::stream_idle, py::arg("stream"),
           "Whether every event recorded on the stream has completed.")
      .def("synchronize", &SimDevice::synchronize, "Complete every event on every stream.")
      .def("set_auto_complete", &SimDevice::set_auto_complete, py::arg("on"),
           "With True, every event completes as soon as it is recorded.")
      .def("set_stream_auto_complete", &SimDevice::set_stream_auto_complete, py::arg("stream"),
           py::arg("on"), "The same for the events of one stream.")
      .def(
          "set_unmap_thread",
          [](SimDevice& d, const std::string& where) {
            if (where == "caller") {
              d.set_unmap_thread(Device::UnmapThread::caller);
            } else if (where == "own") {
              d.set_unmap_thread(Device::UnmapThread::own);
            } else if (where == "own_in_lockstep") {
              d.set_unmap_thread(Device::UnmapThread::own_in_lockstep);
            } else {
              throw py::value_error("unmap thread '" + where +
                                    "': expected caller, own or own_in_lockstep");
            }
          },
          py::arg("where"),
          "Where the allocator makes moved pages' unmap calls (unmap_off_thread): 'caller' "
          "(the default), 'own' (its own thread, as on CUDA) or 'own_in_lockstep' (its own "
          "thread, the allocating thread waiting for each: a replay's calls in one order). "
          "Those of its own thread count as 'unmap_off_thread'.")
      .def("hold_unmaps", &SimDevice::hold_unmaps, py::arg("on"),
           "With True, every unmap blocks until hold_unmaps(False), two seconds at most.",
           py::call_guard<py::gil_scoped_release>())
      .def("counters", &counters_dict, "Count and bytes of every kind of device call.")
      .def("reset_counters", &SimDevice::reset_counters, "Set every call counter to 0.");

  py::class_<CachingAllocator, std::shared_ptr<CachingAllocator>>(
      m, "Allocator",
      "allocwatch's caching allocator on one device. `config`: settings in "
      "PYTORCH_CUDA_ALLOC_CONF syntax ('native' for PyTorch's defaults, keys after it override "
      "them; None for allocwatch's defaults); a bad key or value raises ValueError naming it.")
      .def(py::init([](std::shared_ptr<Device> device, std::optional<std::string> config) {
             return std::make_shared<CachingAllocator>(std::move(device), config_from(config));
           }),
           py::arg("device"), py::arg("config") = py::none(), py::keep_alive<1, 2>(),
           "An allocator on `device` (a SimDevice) with `config`'s settings.")
      .def(
          "malloc",
          [](CachingAllocator& a, std::size_t size, StreamId stream, const py::object& context) {
            TraceContextScope scope(context_from(context));
            return reinterpret_cast<std::uintptr_t>(a.malloc(size, stream));
          },
          py::arg("size"), py::arg("stream") = 0, py::arg("context") = py::none(),
          "Allocate `size` bytes for use on `stream`; returns the address. `context` (any "
          "object) goes with the trace entries the call records. Raises OutOfMemoryError (a "
          "MemoryError) when the device cannot hold it even after freeing cached blocks; its "
          "message states the request, capacity, free, allocated and reserved memory.")
      .def(
          "free",
          [](CachingAllocator& a, std::uintptr_t ptr, const py::object& context) {
            TraceContextScope scope(context_from(context));
            a.free(reinterpret_cast<void*>(ptr));
          },
          py::arg("ptr"), py::arg("context") = py::none(),
          "Give back the block at `ptr` (an address malloc returned) to the cache; it is reused "
          "once every stream it was recorded on has passed this point. ValueError for an "
          "address the allocator did not hand out.")
      .def(
          "record_stream",
          [](CachingAllocator& a, std::uintptr_t ptr, StreamId s) {
            a.record_stream(reinterpret_cast<void*>(ptr), s);
          },
          py::arg("ptr"), py::arg("stream"),
          "Mark the block at `ptr` as used on `stream` too (torch.Tensor.record_stream): its "
          "free waits for that stream's work.")
      .def("block_size",
           [](CachingAllocator& a, std::uintptr_t ptr) { return a.block_size(reinterpret_cast<void*>(ptr)); },
           py::arg("ptr"), "The rounded size of the allocated block at `ptr`; 0 if none.")
      .def("largest_free_block", &CachingAllocator::largest_free_block,
           "The largest cached free block of the large pool (PyTorch's cacheInfo), 0 if none.")
      .def(
          "workspace_room",
          [](CachingAllocator& a, double fresh_for_s) {
            return a.workspace_room(std::chrono::duration_cast<std::chrono::nanoseconds>(
                std::chrono::duration<double>(fresh_for_s)));
          },
          py::arg("fresh_for_s"),
          "The most a new block could get (PyTorch's cacheInfo with no guess, which cuDNN's "
          "benchmark mode asks for each convolution it plans): the device's free memory, asked "
          "at most every `fresh_for_s` seconds and adjusted by this allocator's reserved bytes in "
          "between, or the largest cached free block if larger.")
      // A reclaim may wait on the host (for the device, or the allocator's unmapping thread):
      // other Python threads, an agent's among them, run meanwhile.
      .def("empty_cache", &CachingAllocator::empty_cache,
           "Release every cached block that is not split; returns the bytes released.",
           py::call_guard<py::gil_scoped_release>())
      .def("garbage_collect", &CachingAllocator::garbage_collect,
           "Release aged cached blocks down to the GC threshold; returns the bytes released.")
      .def_property_readonly(
          "capture_underway", [](const CachingAllocator&) { return CachingAllocator::captures_underway(); },
          "Whether a CUDA graph capture is allocating to a private pool of any allocator in "
          "this process (reclaims release nothing meanwhile).")
      .def("process_events", &CachingAllocator::process_events,
           "Return to the cache the freed blocks whose stream events have completed.")
      .def("set_memory_fraction", &CachingAllocator::set_memory_fraction, py::arg("fraction"),
           "As torch.cuda.set_per_process_memory_fraction: cap reserved memory at `fraction` "
           "(0-1] of the device's total.")
      .def("set_memory_limit", &CachingAllocator::set_memory_limit, py::arg("bytes"),
           "The same cap in bytes (0: no cap).")
      .def_property_readonly("memory_limit", &CachingAllocator::memory_limit,
                             "The cap on reserved memory in bytes; 0 when none is set.")
      .def("config", [](CachingAllocator& a) { return config_dict(a.config()); },
           "Every setting in force, as a dict (max_split_size -1: unlimited; 'string': the "
           "settings string).")
      .def("config_string", [](CachingAllocator& a) { return a.config().to_string(); },
           "The settings in force in PYTORCH_CUDA_ALLOC_CONF syntax, every key included.")
      .def("set_config", &CachingAllocator::set_config, py::arg("update"),
           "Change the named settings only; a bad key or value raises ValueError and changes "
           "nothing.")
      .def("stats", &CachingAllocator::stats,
           "Every key of torch.cuda.memory_stats(), flat, with its meaning "
           "('allocated_bytes.all.current', 'reserved_bytes.large_pool.peak', "
           "'num_alloc_retries', ...), plus pending_events, pending_free_bytes, "
           "num_gc_reclaims, gc_reclaimed_bytes and num_empty_cache_calls.")
      .def_property_readonly("reserved_bytes", &CachingAllocator::reserved_bytes,
                             "stats()['reserved_bytes.all.current'] alone, read without "
                             "building the dict.")
      .def_property_readonly("aliases_pages", &CachingAllocator::aliases_pages,
                             "Whether the large pool's pages alias: alias_pages, or "
                             "alias_pages_under_limit with a limit set when its first segment "
                             "was made (a snapshot then lists a page at each of its addresses).")
      .def("reset_peak_stats", &CachingAllocator::reset_peak_stats,
           "Set every '.peak' statistic to its current value "
           "(torch.cuda.reset_peak_memory_stats).")
      .def("reset_accumulated_stats", &CachingAllocator::reset_accumulated_stats,
           "Set the cumulative statistics ('.allocated', '.freed', the num_* counters) to 0.")
      .def(
          "take_interval_peaks",
          [](CachingAllocator& a) {
            const IntervalPeaks p = a.take_interval_peaks();
            py::dict d;
            d["allocated_bytes"] = p.allocated_bytes;
            d["reserved_bytes"] = p.reserved_bytes;
            return d;
          },
          "{'allocated_bytes', 'reserved_bytes'} at their highest since the previous call, "
          "then a new interval from the current values. Separate from the '.peak' statistics, "
          "which it never resets: the agent reads it once per report.")
      .def(
          "begin_allocate_to_pool",
          [](CachingAllocator& a, std::pair<std::uint64_t, std::uint64_t> id, StreamId stream,
             bool plain_segments) {
            a.begin_allocate_to_pool(id, [stream](StreamId s) { return s == stream; },
                                     plain_segments);
          },
          py::arg("pool_id"), py::arg("stream"), py::arg("plain_segments") = false,
          "Start serving allocations on `stream` from the private pool `pool_id` (a pair of "
          "ints), as during CUDA graph capture. plain_segments: the pool's segments are plain "
          "device allocations laid out by PyTorch's rules, as the native back end makes CUDA "
          "graphs' pools.")
      .def("end_allocate_to_pool", &CachingAllocator::end_allocate_to_pool, py::arg("pool_id"),
           "Stop allocating to the private pool `pool_id`; its blocks stay reserved for it.")
      .def("release_pool", &CachingAllocator::release_pool, py::arg("pool_id"),
           "Release the private pool `pool_id`: its free blocks become releasable.")
      .def("create_or_incref_pool", &CachingAllocator::create_or_incref_pool,
           py::arg("pool_id"), py::arg("plain_segments") = false,
           py::arg("segments") = py::none(),
           "Make a private pool (torch.cuda.MemPool's), or share it: its use count + 1. "
           "segments: the device a new pool's segments come from (a MemPool with an allocator "
           "of its own; default: this allocator's device).")
      .def("set_pool_use_on_oom", &CachingAllocator::set_pool_use_on_oom, py::arg("pool_id"),
           py::arg("use_on_oom"),
           "Let requests about to run out of memory take the pool's free blocks (PyTorch's "
           "MemPool option), or stop them.")
      .def("pool_use_count", &CachingAllocator::pool_use_count, py::arg("pool_id"),
           "How many users share the pool `pool_id`; 0 for a pool that does not exist.")
      .def("set_pool_no_split", &CachingAllocator::set_pool_no_split, py::arg("pool_id"),
           "Blocks of the pool `pool_id` are never split (PyTorch's MemPool option).")
      .def("empty_pool_cache", &CachingAllocator::empty_pool_cache, py::arg("pool_id"),
           "Release the cached blocks of a pool nothing uses any more; bytes released.")
      .def("check_pool_live_allocations", &CachingAllocator::check_pool_live_allocations,
           py::arg("pool_id"), py::arg("expected"),
           "Whether the pool's allocated blocks are exactly those at the addresses `expected` "
           "(CUDA graph trees' check that no tensor of a recorded graph is still alive).")
      .def("checkpoint_pool", &CachingAllocator::checkpoint_pool, py::arg("pool_id"),
           "The layout of the private pool `pool_id` (a PoolCheckpoint), for restore_pool.")
      .def(
          "restore_pool",
          [](CachingAllocator& a, const PoolCheckpoint& checkpoint) {
            CheckpointRestore r = a.restore_pool(checkpoint);
            py::dict out;
            out["freed"] = r.freed;
            out["allocated"] = r.allocated;
            return out;
          },
          py::arg("checkpoint"),
          "Bring a private pool back to a checkpoint's layout; {'freed', 'allocated'}: the "
          "blocks freed and allocated to get there.")
      .def(
          "segment_of",
          [](CachingAllocator& a, std::uintptr_t ptr) {
            SegmentSpan s = a.segment_of(reinterpret_cast<const void*>(ptr));
            return py::make_tuple(s.base, s.size, s.expandable);
          },
          py::arg("ptr"), "(base, size, expandable) of the allocation holding an allocated block.")
      .def("clear_history", &CachingAllocator::clear_history,
           "Drop the recorded events; recording goes on if it was on.")
      .def(
          "set_trace_skipped",
          [](CachingAllocator& a, const std::vector<std::string>& actions) {
            a.set_trace_skipped(action_bits(actions));
          },
          py::arg("actions"), "Trace actions (their names) left out of the history.")
      .def(
          "add_trace_observer",
          [](CachingAllocator& a, py::function observer) {
            auto held = std::make_shared<PyTraceContext>();  // released with the GIL held
            held->value = std::move(observer);
            a.add_trace_observer([held](const TraceEntry& e) {
              py::gil_scoped_acquire gil;
              held->value(trace_entry_dict(e));
            });
          },
          py::arg("observer"), "Called with each trace event's dict, recorded or not.")
      .def("record_history", &CachingAllocator::record_history, py::arg("enabled"),
           py::arg("max_entries") = 100000,
           "Start (or stop) recording allocator events in a ring buffer of `max_entries`, as "
           "torch.cuda.memory._record_memory_history; snapshot() includes them.")
      .def("trace",
           [](CachingAllocator& a) {
             py::list out;
             for (const TraceEntry& e : a.trace()) out.append(trace_entry_dict(e));
             return out;
           },
           "The recorded events, oldest first (the layout of a device trace of "
           "torch.cuda.memory._snapshot()).")
      .def_property_readonly("trace_wrapped", &CachingAllocator::trace_wrapped,
                             "Whether the ring buffer dropped its oldest events.")
      .def("snapshot", &snapshot_dict,
           "Segments, blocks, recorded events and settings in the layout of "
           "torch.cuda.memory._snapshot(), which PyTorch's memory viewer and `allocwatch "
           "replay` read.")
      .def("check_invariants", &CachingAllocator::check_invariants,
           "Recount every segment: '' when all invariants hold, else the first violation "
           "(linear in the number of blocks; for tests).");

  // The allocators serving PyTorch, through the native back end or the pluggable path
  // (torch_allocators.h).
  m.def("torch_configure", &torch_allocators::configure, py::arg("settings"),
        "Settings for the allocators that serve PyTorch (named keys only; ValueError if bad).");
  m.def(
      "torch_allocator",
      [](int device) { return torch_allocators::get(device, false); }, py::arg("device"),
      "The allocator serving PyTorch on `device`, or None before torch has used it.");
  m.def(
      "torch_devices",
      [] {
    std::vector<int> devices;
    auto all = torch_allocators::all();
    for (std::size_t i = 0; i < all.size(); ++i)
      if (all[i]) devices.push_back(static_cast<int>(i));
    return devices;
      },
      "The CUDA devices on which an allocator serves PyTorch.");
}
