// Writes new tokens' K and V (k, v[T, Hkv, D]) into the paged caches, in place: token t goes to
// slot slots[t] = block * BS + offset (a negative slot is a padding token: skipped). K in
// 16-byte vectors k_cache[block, h, c, offset, 0..8), V value by value v_cache[block, h, d,
// offset]. Thread (c, h, t) moves K vector c (values 8c .. 8c+7) and the same 8 values of V.
// Thread 0 writes the ordering token `written` (DESIGN.md: readers take it as an input).
// Constants: D, BS. Inputs: k, v, slots (int32[T]), k_cache, v_cache, dims (int32: T, Hkv, slots
// in the pool: a slot past them, which only device slots can hold, is dropped too).
if (thread_position_in_grid.x == 0 && thread_position_in_grid.y == 0 &&
    thread_position_in_grid.z == 0) {
  written[0] = 1u;
}
const uint c = thread_position_in_grid.x;
const uint h = thread_position_in_grid.y;
const uint t = thread_position_in_grid.z;
const uint n_kv = uint(dims[1]);
if (c >= uint(D / 8) || h >= n_kv || t >= uint(dims[0])) return;
const int slot = slots[t];
if (slot < 0 || slot >= dims[2]) return;
const uint block = uint(slot) / uint(BS), off = uint(slot) % uint(BS);
const uint src = (t * n_kv + h) * uint(D) + 8 * c;
auto kc = writable(k_cache);
auto vc = writable(v_cache);
store_wide<uint4>(kc, (((block * n_kv + h) * uint(D / 8) + c) * uint(BS) + off), load_wide<uint4>(k, src / 8));
for (uint j = 0; j < 8; ++j) vc[((block * n_kv + h) * uint(D) + 8 * c + j) * uint(BS) + off] = v[src + j];
