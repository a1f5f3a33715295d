class ParallelConfig:
    worker_extension_cls: str
