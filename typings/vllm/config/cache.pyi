class CacheConfig:
    enable_prefix_caching: bool
