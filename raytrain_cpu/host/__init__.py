"""The machine a rank runs on: CPU features, threads and pinning, the allocator, GEMM timing."""
