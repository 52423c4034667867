"""The suite's shared module: paths, timers, machine and commit capture, and the one record shape every
harness appends to `benchmarks/records/<machine>/<benchmark>.jsonl`.

A harness is run as `python benchmarks/<group>/<harness>.py`; its first lines put the repository root on
`sys.path` (the one bootstrap every harness uses), then import from here:

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # the repository root
    from benchmarks.common import Timer, add_record_args, new_record, save_record

    add_record_args(ap)                                             # --out, --commit
    args = ap.parse_args()
    record = new_record("cpu_generate", "sample-prompts", "smollm2-135m-instruct", commit=args.commit)
    with Timer() as t:
        ...
    record.update(seconds=t.seconds, tokens_per_s=...)
    save_record(record, args.out)                                   # appended to the machine's records
"""
from benchmarks.common.machine import (GIB, ROOT, cuda_available, device_name, git_commit, machine,
                                       machine_slug, package_versions)
from benchmarks.common.records import (COMMON_FIELDS, RECORDS_DIR, add_record_args, append_jsonl, base_record,
                                       command_line, failure_fields, new_record, new_run_id, read_jsonl, read_records,
                                       record_path, records_dir, rewrite_jsonl, save_record, size_gib, utc_now,
                                       write_json_atomic, write_text_atomic)
from benchmarks.common.timing import Timer, median_ms, rows_per_hour
from benchmarks.common.torch_tools import (SYNC_CALLS, close_and_release, empty_host_cache, peak_gib, release_memory,
                                           reset_peak, torch_device, trace_summary, with_layers)

__all__ = ["COMMON_FIELDS", "GIB", "RECORDS_DIR", "ROOT", "SYNC_CALLS", "Timer", "add_record_args", "append_jsonl",
           "base_record", "close_and_release", "command_line", "cuda_available", "device_name", "empty_host_cache",
           "failure_fields", "git_commit", "machine", "machine_slug", "median_ms", "new_record", "new_run_id",
           "package_versions", "peak_gib", "read_jsonl", "read_records", "record_path", "records_dir", "release_memory",
           "reset_peak", "rewrite_jsonl", "rows_per_hour", "save_record", "size_gib", "torch_device",
           "trace_summary", "utc_now", "with_layers", "write_json_atomic", "write_text_atomic"]
