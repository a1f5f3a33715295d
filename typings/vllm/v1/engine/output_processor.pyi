class OutputProcessor:
    # The unfinished requests by internal request id (values: vLLM's RequestState).
    request_states: dict[str, object]
    def get_num_unfinished_requests(self) -> int: ...
