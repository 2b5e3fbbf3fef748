"""
shmkv C++ core: shared-memory chunk table and paged-KV copy kernels
"""
from __future__ import annotations
import collections.abc
import shmkv.errors
import typing
import typing_extensions
__all__: list[str] = ['COUNTERS', 'ERROR_CODES', 'FLAG_COMPRESSED', 'FLAG_SPILLED', 'FORMAT_VERSION', 'LAYOUT_OFFSETS', 'LIMITS', 'Lease', 'LockTimeoutError', 'METRIC_FAMILIES', 'PagedLayout', 'Reservation', 'SegmentBrokenError', 'Status', 'Table', 'byte_shuffle', 'byte_unshuffle', 'byte_unshuffle_into', 'geometry', 'open_table', 'unlink', 'valid_cache_name']
class SegmentBrokenError(shmkv.errors.SegmentCorruptError):
    pass
class LockTimeoutError(shmkv.errors.LockTimeoutError):
    pass
class Status:
    """
    Result codes of the core (cpp/status.h)
    
    Members:
    
      OK
    
      MISS
    
      FULL
    
      EXISTS
    
      BUSY
    
      STALE
    
      TIMED_OUT
    
      INVALID_ARGUMENT
    
      TOO_LARGE
    
      NO_SPACE
    
      NOT_FOUND
    
      ALREADY_EXISTS
    
      MISMATCH
    
      PERMISSION
    
      CORRUPT
    
      SYSTEM
    """
    ALREADY_EXISTS: typing.ClassVar[Status]
    BUSY: typing.ClassVar[Status]
    CORRUPT: typing.ClassVar[Status]
    EXISTS: typing.ClassVar[Status]
    FULL: typing.ClassVar[Status]
    INVALID_ARGUMENT: typing.ClassVar[Status]
    MISMATCH: typing.ClassVar[Status]
    MISS: typing.ClassVar[Status]
    NOT_FOUND: typing.ClassVar[Status]
    NO_SPACE: typing.ClassVar[Status]
    OK: typing.ClassVar[Status]
    PERMISSION: typing.ClassVar[Status]
    STALE: typing.ClassVar[Status]
    SYSTEM: typing.ClassVar[Status]
    TIMED_OUT: typing.ClassVar[Status]
    TOO_LARGE: typing.ClassVar[Status]
    __members__: typing.ClassVar[dict[str, Status]]
    @typing.overload
    def __eq__(self, other: Status) -> bool:
        ...
    @typing.overload
    def __eq__(self, other: typing.Any) -> bool:
        ...
    @typing.overload
    def __ge__(self, other: Status) -> bool:
        ...
    @typing.overload
    def __ge__(self, other: typing.Any) -> None:
        ...
    def __getstate__(self) -> int:
        ...
    @typing.overload
    def __gt__(self, other: Status) -> bool:
        ...
    @typing.overload
    def __gt__(self, other: typing.Any) -> None:
        ...
    def __hash__(self) -> int:
        ...
    def __index__(self) -> int:
        ...
    def __init__(self, value: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    def __int__(self) -> int:
        ...
    @typing.overload
    def __le__(self, other: Status) -> bool:
        ...
    @typing.overload
    def __le__(self, other: typing.Any) -> None:
        ...
    @typing.overload
    def __lt__(self, other: Status) -> bool:
        ...
    @typing.overload
    def __lt__(self, other: typing.Any) -> None:
        ...
    @typing.overload
    def __ne__(self, other: Status) -> bool:
        ...
    @typing.overload
    def __ne__(self, other: typing.Any) -> bool:
        ...
    def __repr__(self) -> str:
        ...
    def __setstate__(self, state: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    def __str__(self) -> str:
        ...
    @property
    def name(self) -> str:
        ...
    @property
    def value(self) -> int:
        ...
class Reservation:
    def abort(self) -> int:
        ...
    def commit(self) -> int:
        ...
    @property
    def address(self) -> int:
        ...
    @property
    def is_open(self) -> bool:
        ...
    @property
    def offset(self) -> int:
        ...
    @property
    def size(self) -> int:
        ...
class Lease:
    def release(self, cold: bool = False) -> int:
        ...
    @property
    def address(self) -> int:
        ...
    @property
    def flags(self) -> int:
        ...
    @property
    def is_open(self) -> bool:
        ...
    @property
    def offset(self) -> int:
        ...
    @property
    def size(self) -> int:
        ...
    @property
    def tokens(self) -> int:
        ...
class Table:
    def acquire(self, key: bytes) -> typing.Any:
        ...
    def acquire_prefix(self, keys: typing.Any, count_lookup: bool = True) -> list:
        ...
    def bump(self, counter: str, n: typing.SupportsInt | typing.SupportsIndex = 1) -> None:
        ...
    def check_consistency(self) -> list[str]:
        ...
    def clear(self, ns: typing.Any = None) -> int:
        ...
    def coldest(self, max_n: typing.SupportsInt | typing.SupportsIndex) -> list:
        ...
    def contains(self, keys: typing.Any) -> bytes:
        ...
    def debug_die_holding_lock(self, arg0: typing.SupportsInt | typing.SupportsIndex, arg1: bool) -> None:
        ...
    def detach(self) -> None:
        ...
    def erase(self, arg0: bytes) -> int:
        ...
    def evict_spilled(self, arg0: bytes) -> int:
        ...
    def file_bytes(self) -> int:
        ...
    def get_into(self, key: bytes, out: typing_extensions.Buffer) -> int:
        ...
    def list_entries(self) -> list:
        ...
    def lock_holder(self) -> tuple[int, float]:
        """
        (pid, seconds) of the process holding the table lock now; pid 0: nobody
        """
    def lookup_prefix(self, keys: typing.Any, count_lookup: bool = True) -> int:
        ...
    def map_arena(self, offset: typing.SupportsInt | typing.SupportsIndex, bytes: typing.SupportsInt | typing.SupportsIndex) -> bool:
        """
        Map the reserved pages of arena bytes [offset, offset + bytes) into this process now.
        """
    def open_handles(self) -> int:
        """
        leases and reservations of this attachment not yet released, committed or aborted
        """
    def pin(self, arg0: bytes) -> int:
        ...
    def probe_lock(self) -> bool:
        """
        Whether the table lock can be had within the bound (taken and given back).
        """
    def put(self, key: bytes, data: typing_extensions.Buffer, ns: typing.Any = None, tokens: typing.SupportsInt | typing.SupportsIndex = 0, flags: typing.SupportsInt | typing.SupportsIndex = 0) -> int:
        ...
    def read_chunks(self, keys: typing.Any, out: typing_extensions.Buffer, offsets: typing_extensions.Buffer, size: typing.SupportsInt | typing.SupportsIndex) -> bytes:
        ...
    def rebuild(self) -> None:
        ...
    def reclaim(self) -> dict:
        ...
    def release_role(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> None:
        ...
    def removal_count(self) -> int:
        """
        evictions + deletes + segment resets: moves whenever a chunk may have left the table
        """
    def renew_spill_guard(self, seconds: typing.SupportsFloat | typing.SupportsIndex) -> None:
        """
        while its spills reach the disk, the maintainer keeps puts to evicting spilled chunks
        """
    def reserve(self, key: bytes, size: typing.SupportsInt | typing.SupportsIndex, ns: typing.Any = None, tokens: typing.SupportsInt | typing.SupportsIndex = 0, flags: typing.SupportsInt | typing.SupportsIndex = 0) -> tuple:
        ...
    def reserve_more(self, max_bytes: typing.SupportsInt | typing.SupportsIndex, map_pages: bool) -> tuple:
        """
        Reserve up to max_bytes more of the arena's pages (then map them with map_pages); (status, message, arena bytes reserved now).
        """
    def restore_size(self) -> tuple:
        """
        Grow a truncated segment file back and reset the table; (status, message).
        """
    def role_held_elsewhere(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> bool:
        ...
    def set_flags(self, arg0: bytes, arg1: typing.SupportsInt | typing.SupportsIndex) -> int:
        ...
    def spill_guard_active(self) -> bool:
        ...
    def stats(self) -> dict[str, int]:
        ...
    def try_hold_role(self, arg0: typing.SupportsInt | typing.SupportsIndex) -> bool:
        ...
    def unpin(self, arg0: bytes) -> int:
        ...
    def write_chunks(self, keys: typing.Any, src: typing_extensions.Buffer, offsets: typing_extensions.Buffer, size: typing.SupportsInt | typing.SupportsIndex, ns: typing.Any = None, tokens: typing.SupportsInt | typing.SupportsIndex = 0) -> bytes:
        ...
    @property
    def arena_address(self) -> int:
        ...
    @property
    def arena_bytes(self) -> int:
        ...
    @property
    def capacity_bytes(self) -> int:
        ...
    @property
    def max_payload_bytes(self) -> int:
        ...
    @property
    def name(self) -> str:
        ...
class PagedLayout:
    def __init__(self, layer_bases: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex], geometry: typing.Any) -> None:
        """
        One KV-cache group: its layers' base addresses and its geometry (shmkv.transfer.layout.LayoutGeometry).
        """
    def gather_blocks(self, block_ids: typing_extensions.Buffer, payload: typing_extensions.Buffer, payload_first: typing.SupportsInt | typing.SupportsIndex = 0, payload_blocks: typing.SupportsInt | typing.SupportsIndex = -1, layer_begin: typing.SupportsInt | typing.SupportsIndex = 0, layer_end: typing.SupportsInt | typing.SupportsIndex = -1) -> None:
        ...
    def gather_tokens(self, slot_mapping: typing_extensions.Buffer, payload: typing_extensions.Buffer, layer_begin: typing.SupportsInt | typing.SupportsIndex = 0, layer_end: typing.SupportsInt | typing.SupportsIndex = -1) -> None:
        ...
    def scatter_blocks(self, block_ids: typing_extensions.Buffer, payload: typing_extensions.Buffer, payload_first: typing.SupportsInt | typing.SupportsIndex = 0, payload_blocks: typing.SupportsInt | typing.SupportsIndex = -1, layer_begin: typing.SupportsInt | typing.SupportsIndex = 0, layer_end: typing.SupportsInt | typing.SupportsIndex = -1) -> None:
        ...
    def scatter_tokens(self, slot_mapping: typing_extensions.Buffer, payload: typing_extensions.Buffer, layer_begin: typing.SupportsInt | typing.SupportsIndex = 0, layer_end: typing.SupportsInt | typing.SupportsIndex = -1) -> None:
        ...
    def token_copy_runs(self, slot_mapping: typing_extensions.Buffer, layer_begin: typing.SupportsInt | typing.SupportsIndex = 0, layer_end: typing.SupportsInt | typing.SupportsIndex = -1) -> tuple[int, int]:
        """
        (runs, bytes) a copy-engine copy of these slots would issue: contiguous runs, adjacent ones merged.
        """
    @property
    def block_bytes(self) -> int:
        ...
    @property
    def num_layers(self) -> int:
        ...
    @property
    def token_mode(self) -> bool:
        ...
    @property
    def token_payload_bytes(self) -> int:
        ...
def byte_shuffle(data: typing_extensions.Buffer, element_size: typing.SupportsInt | typing.SupportsIndex) -> bytes:
    """
    Byte-plane shuffle (elements -> planes).
    """
def byte_unshuffle(data: typing_extensions.Buffer, element_size: typing.SupportsInt | typing.SupportsIndex) -> bytes:
    """
    Inverse of byte_shuffle.
    """
def byte_unshuffle_into(data: typing_extensions.Buffer, element_size: typing.SupportsInt | typing.SupportsIndex, out: typing_extensions.Buffer) -> None:
    """
    Inverse of byte_shuffle, written into `out` (same size), without the GIL.
    """
def geometry(arg0: typing.SupportsInt | typing.SupportsIndex, arg1: typing.SupportsInt | typing.SupportsIndex, arg2: typing.SupportsInt | typing.SupportsIndex, arg3: typing.SupportsInt | typing.SupportsIndex, arg4: typing.SupportsInt | typing.SupportsIndex, arg5: typing.SupportsInt | typing.SupportsIndex) -> tuple:
    ...
def open_table(name: str, segment_dir: str, mode: typing.SupportsInt | typing.SupportsIndex, capacity_bytes: typing.SupportsInt | typing.SupportsIndex, max_payload_bytes: typing.SupportsInt | typing.SupportsIndex, alignment: typing.SupportsInt | typing.SupportsIndex, max_entries: typing.SupportsInt | typing.SupportsIndex, max_leases: typing.SupportsInt | typing.SupportsIndex, max_procs: typing.SupportsInt | typing.SupportsIndex, populate: bool, lock_timeout_s: typing.SupportsFloat | typing.SupportsIndex = 0.3, init_wait_s: typing.SupportsFloat | typing.SupportsIndex = 120.0) -> tuple:
    """
    Open the segment `name` in `segment_dir` ("": POSIX shm, /dev/shm); returns (status, message, Table | None, outcome).
    """
def unlink(name: str, segment_dir: str) -> tuple:
    """
    Remove the segment `name` of `segment_dir` ("": POSIX shm).
    """
def valid_cache_name(name: str) -> bool:
    """
    Whether `name` is a cache (segment) name the core accepts: LIMITS['cache_name_max'] characters at most of [A-Za-z0-9._-], not starting with '.'.
    """
COUNTERS: tuple = (('lookups', 'Keys looked up in the shared tier', 'counter', 'shm', False, 'lookups'), ('hits', 'Keys found in the shared tier', 'counter', 'shm', False, 'hits'), ('misses', 'Lookups that ended a cached prefix', 'counter', 'shm', False, 'misses'), ('puts', 'Chunks committed to the shared tier', 'counter', 'shm', False, 'puts'), ('put_bytes', 'Payload bytes committed to the shared tier', 'counter', 'shm', False, 'put_bytes'), ('put_full', 'Puts refused because nothing could be evicted', 'counter', 'shm', False, 'put_full'), ('put_exists', 'Puts of chunks already cached', 'counter', 'shm', False, 'put_exists'), ('put_busy', 'Puts of chunks another process was writing', 'counter', 'shm', False, 'put_busy'), ('put_unreserved', 'Puts refused because the arena was still being reserved in the background', 'counter', 'shm', False, 'put_unreserved'), ('liveness_unshared', 'Forked processes that could not open a description of their own (/proc/self/fd): presumed alive with their parent', 'counter', 'shm', False, 'liveness_unshared'), ('reserve_errors', "Background reservations of the arena's pages that failed (/dev/shm full)", 'counter', 'shm', False, 'reserve_errors'), ('put_too_large', 'Puts larger than the largest chunk allowed', 'counter', 'shm', False, 'put_too_large'), ('evictions', 'Chunks evicted from the shared tier', 'counter', 'shm', False, 'evictions'), ('evicted_bytes', 'Payload bytes evicted from the shared tier', 'counter', 'shm', False, 'evicted_bytes'), ('evicted_unspilled', 'Evictions of chunks that were not on disk', 'counter', 'shm', False, 'evicted_unspilled'), ('put_spill_behind', 'Puts refused while writes outran the disk tier (the spill guard keeps chunks not yet on disk)', 'counter', 'shm', False, 'put_spill_behind'), ('writes_aborted', 'Writes aborted by their writer', 'counter', 'shm', False, 'writes_aborted'), ('writes_reclaimed', 'Unfinished writes of dead processes freed', 'counter', 'shm', False, 'writes_reclaimed'), ('leases_reclaimed', 'Read leases of dead processes released', 'counter', 'shm', False, 'leases_reclaimed'), ('lease_table_full', 'Reads refused because the lease table was full', 'counter', 'shm', False, 'lease_table_full'), ('entry_table_full', 'Puts that had to evict to find an entry record', 'counter', 'shm', False, 'entry_table_full'), ('stale_handles', 'Commits or releases of a handle that had been reclaimed', 'counter', 'shm', False, 'stale_handles'), ('deletes', 'Chunks deleted', 'counter', 'shm', False, 'deletes'), ('pins', 'Pin operations', 'counter', 'shm', False, 'pins'), ('lock_recoveries', 'Table rebuilds after a process died holding the lock', 'counter', 'shm', False, 'lock_recoveries'), ('segment_resets', 'Segments emptied because they could not be rebuilt', 'counter', 'shm', False, 'segment_resets'), ('index_rehashes', 'Hash index clean-ups of tombstones', 'counter', 'shm', False, 'index_rehashes'), ('procs_table_full', 'Attaches beyond the process table (not tracked for reclaim)', 'counter', 'shm', False, 'procs_table_full'), ('lock_timeouts', 'Waits for the table lock that hit the bound (answered miss/busy)', 'counter', 'shm', False, 'lock_timeouts'), ('deferred_ops', 'Commits/releases queued behind a table lock held too long', 'counter', 'shm', False, 'deferred_ops'), ('metadata_repairs', 'Damaged derived metadata found and rebuilt', 'counter', 'shm', False, 'metadata_repairs'), ('segment_truncated', 'Times the segment file was found truncated (and restored)', 'counter', 'shm', False, 'segment_truncated'), ('hit_tokens', 'Prompt tokens vLLM got from chunks found in the shared tier', 'counter', 'shm', True, 'hit_tokens'), ('put_tokens', 'Prompt tokens of the chunks committed to the shared tier', 'counter', 'shm', False, 'put_tokens'), ('bytes_used', 'Payload bytes in use', 'gauge', 'shm', False, 'bytes_used'), ('entries', 'Chunks held (any state)', 'gauge', 'shm', False, 'entries'), ('ready_entries', 'Chunks readable now', 'gauge', 'shm', False, 'ready_entries'), ('pinned_entries', 'Chunks pinned', 'gauge', 'shm', False, 'pinned_entries'), ('compressed_entries', 'Chunks held compressed (POST /compress)', 'gauge', 'shm', False, 'compressed_entries'), ('compressed_bytes', 'Payload bytes of the chunks held compressed', 'gauge', 'shm', False, 'compressed_bytes'), ('leases_held', 'Read leases held now', 'gauge', 'shm', False, 'leases_held'), ('evictable_bytes', 'Payload bytes of chunks that could be evicted now', 'gauge', 'shm', False, 'evictable_bytes'), ('processes_attached', 'Processes attached to the segment', 'gauge', 'shm', False, 'processes_attached'), ('lock_holder_pid', 'Process holding the table lock now (0: none)', 'gauge', 'shm', False, 'lock_holder_pid'), ('lock_held_ms', 'How long the current holder has held the table lock', 'gauge', 'shm', False, 'lock_held_ms'), ('arena_bytes', 'Payload byte cap', 'gauge', 'shm', False, 'arena_bytes'), ('arena_reserved_bytes', 'Arena bytes whose pages are reserved (the rest is reserved in the background after creation)', 'gauge', 'shm', False, 'arena_reserved_bytes'), ('capacity_bytes', 'Size of the shared segment', 'gauge', 'shm', False, 'capacity_bytes'), ('max_payload_bytes', 'Largest chunk payload accepted', 'info', 'shm', False, 'max_payload_bytes'), ('max_entries', 'Entry records in the table', 'info', 'shm', False, 'max_entries'), ('max_leases', 'Lease records in the table', 'info', 'shm', False, 'max_leases'), ('alignment', 'Payload alignment in bytes', 'info', 'shm', False, 'alignment'), ('epoch', 'Resets of the segment since it was created', 'info', 'shm', False, 'epoch'), ('creator_pid', 'Process that created the segment', 'info', 'shm', False, 'creator_pid'), ('created_unix_ns', 'When the segment was created', 'info', 'shm', False, 'created_unix_ns'), ('lock_timeout_ms', 'Bound of a wait for the table lock (this process)', 'info', 'shm', False, 'lock_timeout_ms'), ('file_bytes', 'Size of the segment file now', 'info', 'shm', False, 'file_bytes'), ('spills', 'Chunks written to the disk tier', 'counter', 'disk', True, 'puts'), ('spill_tokens', 'Prompt tokens of the chunks spilled', 'counter', 'disk', True, 'put_tokens'), ('spill_bytes', 'Raw bytes written to the disk tier', 'counter', 'disk', True, 'put_bytes'), ('spill_errors', 'Spills that failed (disk full, I/O error)', 'counter', 'disk', True, 'put_errors'), ('disk_hits', 'Chunks promoted from disk into the shared tier', 'counter', 'disk', True, 'hits'), ('promote_bytes', 'Raw bytes promoted from a lower tier', 'counter', 'disk', True, 'promote_bytes'), ('disk_hit_tokens', 'Prompt tokens vLLM got from chunks found on disk', 'counter', 'disk', True, 'hit_tokens'), ('promote_errors', 'Promotions that failed', 'counter', 'disk', True, 'promote_errors'), ('disk_damaged', 'Damaged disk chunks found and removed', 'counter', 'disk', True, 'damaged'), ('disk_removed', 'Disk chunks removed by the byte cap', 'counter', 'disk', True, 'disk_removed'), ('remote_puts', 'Chunks written to the remote tier', 'counter', 'remote', True, 'puts'), ('remote_put_tokens', 'Prompt tokens of the chunks written to the remote tier', 'counter', 'remote', True, 'put_tokens'), ('remote_put_bytes', 'Encoded bytes written to the remote tier', 'counter', 'remote', True, 'put_bytes'), ('remote_put_errors', 'Remote writes that failed (down, timeout)', 'counter', 'remote', True, 'put_errors'), ('remote_dropped', 'Remote writes dropped (queue full, chunk gone)', 'counter', 'remote', True, 'remote_dropped'), ('remote_hits', 'Chunks promoted from the remote tier', 'counter', 'remote', True, 'hits'), ('remote_hit_tokens', 'Prompt tokens vLLM got from chunks found in the remote tier', 'counter', 'remote', True, 'hit_tokens'), ('remote_get_bytes', 'Encoded bytes read from the remote tier', 'counter', 'remote', True, 'remote_get_bytes'), ('remote_misses', 'Remote lookups that did not find every chunk asked for (or got no answer)', 'counter', 'remote', True, 'misses'), ('remote_errors', 'Remote calls that failed or timed out', 'counter', 'remote', True, 'remote_errors'), ('remote_damaged', 'Remote values rejected by the chunk checks', 'counter', 'remote', True, 'damaged'), ('remote_foreign', "Remote values under our key id's names that carry another key id (planted without the secret), removed", 'counter', 'remote', True, 'foreign'), ('remote_expired', 'Remote values past the expiry their writer signed (remote_ttl), removed', 'counter', 'remote', True, 'expired'), ('remote_stale', 'Remote values signed before a clear of their namespace or of everything (an older generation), removed', 'counter', 'remote', True, 'stale'), ('remote_healed', 'Clear-generation records found erased or rolled back (a signed value or this host knew a newer one), written back', 'counter', 'remote', True, 'healed'))
ERROR_CODES: frozenset
FLAG_COMPRESSED: int = 2
FLAG_SPILLED: int = 1
FORMAT_VERSION: int = 10
LAYOUT_OFFSETS: dict = {'lock': 192, 'lock_holder_pid': 232, 'lru_head': 256, 'lru_tail': 260, 'free_entry_head': 264, 'free_lease_head': 268, 'num_extents': 272, 'evictable_bytes': 304, 'geo_max_entries': 72, 'header_bytes': 896, 'entry_bytes': 104, 'entry_offset': 16}
LIMITS: dict = {'cache_name_max': 200, 'lock_timeout_s': (0.001, 60.0), 'lock_timeout_default_s': 0.3, 'chunk_size': (16, 65536)}
METRIC_FAMILIES: dict = {'hits': 'Chunks found per tier (shm: lookups that hit; disk, remote: chunks promoted into memory)', 'misses': 'Lookups that ended a cached prefix in the tier', 'puts': 'Chunks written to the tier (shm: committed; disk: spilled; remote: written)', 'hit_tokens': 'Prompt tokens vLLM got from shmkv, by the tier their chunks were found in', 'put_tokens': 'Prompt tokens written to the tier (shm: committed; disk: spilled; remote: written)', 'put_bytes': 'Bytes written to the tier (shm: committed payload; disk: raw; remote: encoded)', 'put_errors': 'Writes to the tier that failed (disk full, I/O error, remote down or timed out)', 'damaged': 'Damaged chunks found in the tier and removed'}
__version__: str = '0.1.0'
