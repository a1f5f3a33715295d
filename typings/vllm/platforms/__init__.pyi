from vllm.platforms.interface import Platform

current_platform: Platform
