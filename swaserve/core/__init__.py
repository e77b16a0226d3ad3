"""Engine-core processes and their IPC: the core loop (`engine_core`), its messages (`messages`), and
the frontend's handle on a running core (`process`)."""
