// counters.h — the one list of what the segment counts, for C++ and Python.
//
// Every statistic ChunkTable::stats() returns is named here once, with its
// help text, its kind and the tier it describes. bindings.cpp exports the
// list as shmkv._C.COUNTERS; shmkv/stats.py builds `python -m shmkv.stats`
// and the Prometheus families from it, and the Python tiers may bump only the
// entries marked `bumpable` (their events: spills, remote writes...).
//
//   kind "counter"  monotonic event count (Prometheus: shmkv_<name>_total)
//        "gauge"    a level that goes up and down
//        "info"     configuration or identity: shown by stats, not exported
//   member          the field of Counters (layout.h) that holds it; nullptr
//                   for values stats() computes at read time
//   family          the Prometheus family it is one tier's sample of (one
//                   metric per quantity, the tier a label: shmkv_hits_total
//                   {tier="shm|disk|remote"}); nullptr: its own name
#pragma once

#include <atomic>
#include <cstdint>

#include "layout.h"

namespace shmkv {

struct CounterInfo {
  const char* name;
  std::atomic<uint64_t> Counters::*member;
  const char* kind;
  const char* tier;  // "shm" | "disk" | "remote"
  bool bumpable;     // events of the Python tiers (ChunkTable::bump)
  const char* help;
  const char* family = nullptr;
};

// Help text of the families several tiers share.
struct FamilyInfo {
  const char* name;
  const char* help;
};

inline constexpr FamilyInfo kFamilies[] = {
    {"hits", "Chunks found per tier (shm: lookups that hit; disk, remote: chunks promoted into memory)"},
    {"misses", "Lookups that ended a cached prefix in the tier"},
    {"puts", "Chunks written to the tier (shm: committed; disk: spilled; remote: written)"},
    {"hit_tokens", "Prompt tokens vLLM got from shmkv, by the tier their chunks were found in"},
    {"put_tokens", "Prompt tokens written to the tier (shm: committed; disk: spilled; remote: written)"},
    {"put_bytes", "Bytes written to the tier (shm: committed payload; disk: raw; remote: encoded)"},
    {"put_errors", "Writes to the tier that failed (disk full, I/O error, remote down or timed out)"},
    {"damaged", "Damaged chunks found in the tier and removed"},
};

inline constexpr CounterInfo kCounters[] = {
    // --- shared tier: events ----------------------------------------------------
    {"lookups", &Counters::lookups, "counter", "shm", false, "Keys looked up in the shared tier"},
    {"hits", &Counters::hits, "counter", "shm", false, "Keys found in the shared tier", "hits"},
    {"misses", &Counters::misses, "counter", "shm", false, "Lookups that ended a cached prefix", "misses"},
    {"puts", &Counters::puts, "counter", "shm", false, "Chunks committed to the shared tier", "puts"},
    {"put_bytes", &Counters::put_bytes, "counter", "shm", false, "Payload bytes committed to the shared tier",
     "put_bytes"},
    {"put_full", &Counters::put_full, "counter", "shm", false, "Puts refused because nothing could be evicted"},
    {"put_exists", &Counters::put_exists, "counter", "shm", false, "Puts of chunks already cached"},
    {"put_busy", &Counters::put_busy, "counter", "shm", false, "Puts of chunks another process was writing"},
    {"put_unreserved", &Counters::put_unreserved, "counter", "shm", false,
     "Puts refused because the arena was still being reserved in the background"},
    {"liveness_unshared", &Counters::liveness_unshared, "counter", "shm", false,
     "Forked processes that could not open a description of their own (/proc/self/fd): presumed alive with their parent"},
    {"reserve_errors", &Counters::reserve_errors, "counter", "shm", false,
     "Background reservations of the arena's pages that failed (/dev/shm full)"},
    {"put_too_large", &Counters::put_too_large, "counter", "shm", false, "Puts larger than the largest chunk allowed"},
    {"evictions", &Counters::evictions, "counter", "shm", false, "Chunks evicted from the shared tier"},
    {"evicted_bytes", &Counters::evicted_bytes, "counter", "shm", false, "Payload bytes evicted from the shared tier"},
    {"evicted_unspilled", &Counters::evicted_unspilled, "counter", "shm", false,
     "Evictions of chunks that were not on disk"},
    {"put_spill_behind", &Counters::put_spill_behind, "counter", "shm", false,
     "Puts refused while writes outran the disk tier (the spill guard keeps chunks not yet on disk)"},
    {"writes_aborted", &Counters::writes_aborted, "counter", "shm", false, "Writes aborted by their writer"},
    {"writes_reclaimed", &Counters::writes_reclaimed, "counter", "shm", false,
     "Unfinished writes of dead processes freed"},
    {"leases_reclaimed", &Counters::leases_reclaimed, "counter", "shm", false,
     "Read leases of dead processes released"},
    {"lease_table_full", &Counters::lease_table_full, "counter", "shm", false,
     "Reads refused because the lease table was full"},
    {"entry_table_full", &Counters::entry_table_full, "counter", "shm", false,
     "Puts that had to evict to find an entry record"},
    {"stale_handles", &Counters::stale_handles, "counter", "shm", false,
     "Commits or releases of a handle that had been reclaimed"},
    {"deletes", &Counters::deletes, "counter", "shm", false, "Chunks deleted"},
    {"pins", &Counters::pins, "counter", "shm", false, "Pin operations"},
    {"lock_recoveries", &Counters::lock_recoveries, "counter", "shm", false,
     "Table rebuilds after a process died holding the lock"},
    {"segment_resets", &Counters::segment_resets, "counter", "shm", false,
     "Segments emptied because they could not be rebuilt"},
    {"index_rehashes", &Counters::index_rehashes, "counter", "shm", false, "Hash index clean-ups of tombstones"},
    {"procs_table_full", &Counters::procs_table_full, "counter", "shm", false,
     "Attaches beyond the process table (not tracked for reclaim)"},
    {"lock_timeouts", &Counters::lock_timeouts, "counter", "shm", false,
     "Waits for the table lock that hit the bound (answered miss/busy)"},
    {"deferred_ops", &Counters::deferred_ops, "counter", "shm", false,
     "Commits/releases queued behind a table lock held too long"},
    {"metadata_repairs", &Counters::metadata_repairs, "counter", "shm", false,
     "Damaged derived metadata found and rebuilt"},
    {"segment_truncated", &Counters::segment_truncated, "counter", "shm", false,
     "Times the segment file was found truncated (and restored)"},
    {"hit_tokens", &Counters::hit_tokens, "counter", "shm", true,
     "Prompt tokens vLLM got from chunks found in the shared tier", "hit_tokens"},
    {"put_tokens", &Counters::put_tokens, "counter", "shm", false,
     "Prompt tokens of the chunks committed to the shared tier", "put_tokens"},
    // --- shared tier: levels --------------------------------------------------------
    {"bytes_used", &Counters::bytes_used, "gauge", "shm", false, "Payload bytes in use"},
    {"entries", &Counters::entries, "gauge", "shm", false, "Chunks held (any state)"},
    {"ready_entries", &Counters::ready_entries, "gauge", "shm", false, "Chunks readable now"},
    {"pinned_entries", &Counters::pinned_entries, "gauge", "shm", false, "Chunks pinned"},
    {"compressed_entries", &Counters::compressed_entries, "gauge", "shm", false,
     "Chunks held compressed (POST /compress)"},
    {"compressed_bytes", &Counters::compressed_bytes, "gauge", "shm", false,
     "Payload bytes of the chunks held compressed"},
    {"leases_held", nullptr, "gauge", "shm", false, "Read leases held now"},
    {"evictable_bytes", nullptr, "gauge", "shm", false, "Payload bytes of chunks that could be evicted now"},
    {"processes_attached", nullptr, "gauge", "shm", false, "Processes attached to the segment"},
    {"lock_holder_pid", nullptr, "gauge", "shm", false, "Process holding the table lock now (0: none)"},
    {"lock_held_ms", nullptr, "gauge", "shm", false, "How long the current holder has held the table lock"},
    {"arena_bytes", nullptr, "gauge", "shm", false, "Payload byte cap"},
    {"arena_reserved_bytes", nullptr, "gauge", "shm", false,
     "Arena bytes whose pages are reserved (the rest is reserved in the background after creation)"},
    {"capacity_bytes", nullptr, "gauge", "shm", false, "Size of the shared segment"},
    // --- shared tier: configuration and identity ----------------------------------
    {"max_payload_bytes", nullptr, "info", "shm", false, "Largest chunk payload accepted"},
    {"max_entries", nullptr, "info", "shm", false, "Entry records in the table"},
    {"max_leases", nullptr, "info", "shm", false, "Lease records in the table"},
    {"alignment", nullptr, "info", "shm", false, "Payload alignment in bytes"},
    {"epoch", nullptr, "info", "shm", false, "Resets of the segment since it was created"},
    {"creator_pid", nullptr, "info", "shm", false, "Process that created the segment"},
    {"created_unix_ns", nullptr, "info", "shm", false, "When the segment was created"},
    {"lock_timeout_ms", nullptr, "info", "shm", false, "Bound of a wait for the table lock (this process)"},
    {"file_bytes", nullptr, "info", "shm", false, "Size of the segment file now"},
    // --- disk tier (bumped by shmkv/disk/tier.py and the tier chain) ---------------
    {"spills", &Counters::spills, "counter", "disk", true, "Chunks written to the disk tier", "puts"},
    {"spill_tokens", &Counters::spill_tokens, "counter", "disk", true, "Prompt tokens of the chunks spilled",
     "put_tokens"},
    {"spill_bytes", &Counters::spill_bytes, "counter", "disk", true, "Raw bytes written to the disk tier", "put_bytes"},
    {"spill_errors", &Counters::spill_errors, "counter", "disk", true, "Spills that failed (disk full, I/O error)", "put_errors"},
    {"disk_hits", &Counters::disk_hits, "counter", "disk", true, "Chunks promoted from disk into the shared tier", "hits"},
    {"promote_bytes", &Counters::promote_bytes, "counter", "disk", true, "Raw bytes promoted from a lower tier"},
    {"disk_hit_tokens", &Counters::disk_hit_tokens, "counter", "disk", true,
     "Prompt tokens vLLM got from chunks found on disk", "hit_tokens"},
    {"promote_errors", &Counters::promote_errors, "counter", "disk", true, "Promotions that failed"},
    {"disk_damaged", &Counters::disk_damaged, "counter", "disk", true, "Damaged disk chunks found and removed", "damaged"},
    {"disk_removed", &Counters::disk_removed, "counter", "disk", true, "Disk chunks removed by the byte cap"},
    // --- remote tier (bumped by shmkv/remote/tier.py and the tier chain) -----------
    {"remote_puts", &Counters::remote_puts, "counter", "remote", true, "Chunks written to the remote tier", "puts"},
    {"remote_put_tokens", &Counters::remote_put_tokens, "counter", "remote", true,
     "Prompt tokens of the chunks written to the remote tier", "put_tokens"},
    {"remote_put_bytes", &Counters::remote_put_bytes, "counter", "remote", true,
     "Encoded bytes written to the remote tier", "put_bytes"},
    {"remote_put_errors", &Counters::remote_put_errors, "counter", "remote", true,
     "Remote writes that failed (down, timeout)", "put_errors"},
    {"remote_dropped", &Counters::remote_dropped, "counter", "remote", true,
     "Remote writes dropped (queue full, chunk gone)"},
    {"remote_hits", &Counters::remote_hits, "counter", "remote", true, "Chunks promoted from the remote tier", "hits"},
    {"remote_hit_tokens", &Counters::remote_hit_tokens, "counter", "remote", true,
     "Prompt tokens vLLM got from chunks found in the remote tier", "hit_tokens"},
    {"remote_get_bytes", &Counters::remote_get_bytes, "counter", "remote", true,
     "Encoded bytes read from the remote tier"},
    {"remote_misses", &Counters::remote_misses, "counter", "remote", true,
     "Remote lookups that did not find every chunk asked for (or got no answer)", "misses"},
    {"remote_errors", &Counters::remote_errors, "counter", "remote", true, "Remote calls that failed or timed out"},
    {"remote_damaged", &Counters::remote_damaged, "counter", "remote", true,
     "Remote values rejected by the chunk checks", "damaged"},
    {"remote_foreign", &Counters::remote_foreign, "counter", "remote", true,
     "Remote values under our key id's names that carry another key id (planted without the secret), removed",
     "foreign"},
    {"remote_expired", &Counters::remote_expired, "counter", "remote", true,
     "Remote values past the expiry their writer signed (remote_ttl), removed", "expired"},
    {"remote_stale", &Counters::remote_stale, "counter", "remote", true,
     "Remote values signed before a clear of their namespace or of everything (an older generation), removed",
     "stale"},
    {"remote_healed", &Counters::remote_healed, "counter", "remote", true,
     "Clear-generation records found erased or rolled back (a signed value or this host knew a newer one), "
     "written back", "healed"},
};

}  // namespace shmkv
