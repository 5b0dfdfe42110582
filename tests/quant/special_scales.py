"""fp16 scale values that stress a decoder: shared by the codec and kernel tests."""

import numpy as np

F16_SPECIALS = np.array(
    [
        0x0001, 0x03FF, 0x8001, 0x8200,  # subnormals
        0x7C00, 0xFC00,  # +Inf, -Inf
        0x7E00, 0xFE00, 0x7C01, 0x7D55,  # quiet / signalling NaNs with payloads
        0x0000, 0x8000, 0x7BFF, 0x3C00,  # 0, -0, max finite, 1
    ],
    np.uint16,
)  # fmt: skip
