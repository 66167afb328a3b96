"""Suite-wide settings.

One torch thread per process: the suite runs several processes at once (swarm peers) on
two cores, and OpenMP worker threads spinning on oversubscribed cores slow every step many
times over.
"""

import torch

torch.set_num_threads(1)
