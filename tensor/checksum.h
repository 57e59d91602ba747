// CRC-32 (IEEE 802.3, reflected; the checksum of zlib's crc32 and Python's zlib.crc32), used
// to verify that checkpoint files read back exactly as they were written.
#pragma once

#include <cstdint>
#include <span>

namespace rd {

// The CRC-32 of the bytes seen so far, continued over `bytes`; start from 0.
uint32_t crc32_update(uint32_t crc, std::span<const uint8_t> bytes);

}  // namespace rd
