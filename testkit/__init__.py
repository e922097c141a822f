"""Data builders shared by the tests, the benchmarks and the GPU check; not part of the library (not installed)."""
