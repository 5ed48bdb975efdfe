"""The byte formats kvstore speaks beyond protobuf, each a pure encoder and decoder with no
I/O (every side imports them): ``data`` (the TCP data channel's frames), ``shm`` (the
shared-memory gate's hello and reply), ``kv`` (KV events as vLLM's msgpack batches) and
``proto`` (the protobuf varints of the messages encoded by hand)."""
