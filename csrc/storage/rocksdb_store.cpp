// veloce._rocksdb: a RocksDB database holding a tiered table's entries (id -> row, optimizer
// state, score) behind one long-lived handle, torch.classes.veloce_rocksdb.Store.
//
// A torch.classes custom class rather than pybind11: it builds under Py_LIMITED_API like
// veloce._C (one abi3 library for every Python), its methods take and return tensors,
// and the Python side (veloce/ops/rocksdb.py) needs no binding code.
//
// Layout on disk:
//   * column family "default": one record per entry. Key: the id as 8 bytes big-endian
//     with the sign bit flipped, so byte order is id order. Value: the row's bytes | the
//     optimizer state's bytes | the score (int64, little-endian): dim * sizeof(dtype) +
//     state_dim * sizeof(state_dtype) + 8 bytes.
//   * column family "veloce_meta": "layout" (the text of Layout::text(), written when the
//     database is created and checked on every open) and "count" (the number of entries,
//     int64, updated in the same WriteBatch as the records it counts, so it is exact
//     after any crash).
//
// Every batch is one WriteBatch (atomic: a crash or a failed write leaves all of it or
// none), every read of a batch one sorted MultiGet per chunk of ids, never a call per id.

#include <Python.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/StringUtil.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <rocksdb/cache.h>
#include <rocksdb/db.h>
#include <rocksdb/filter_policy.h>
#include <rocksdb/options.h>
#include <rocksdb/slice.h>
#include <rocksdb/table.h>
#include <rocksdb/write_batch.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>
#include <queue>
#include <shared_mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

extern "C" {
// An empty module: importing veloce._rocksdb loads the library, whose static initializers
// register the class.
PyMODINIT_FUNC PyInit__rocksdb(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_rocksdb", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

namespace veloce {
namespace {

using at::Tensor;
using Entries = std::tuple<Tensor, Tensor, Tensor, Tensor>;

constexpr int64_t kFormatVersion = 1;
constexpr int64_t kGetGrain = 4096;  // ids per MultiGet call (one thread's share)
constexpr uint64_t kSignBit = uint64_t{1} << 63;
const char* const kMetaFamily = "veloce_meta";
const char* const kLayoutKey = "layout";
const char* const kCountKey = "count";

at::ScalarType dtype_from_name(const std::string& name, const char* arg) {
  if (name == "float32") return at::kFloat;
  if (name == "float64") return at::kDouble;
  if (name == "float16") return at::kHalf;
  if (name == "bfloat16") return at::kBFloat16;
  TORCH_CHECK_VALUE(false, arg, " must be one of float32, float64, float16, bfloat16, got ", name);
}

// The 8-byte key of an id: big-endian of (id ^ sign bit), so unsigned order = id order.
inline uint64_t order_of(int64_t id) { return static_cast<uint64_t>(id) ^ kSignBit; }
inline void encode_key(int64_t id, char* out) {
  uint64_t u = order_of(id);
  for (int b = 7; b >= 0; --b, u >>= 8) out[b] = static_cast<char>(u & 0xff);
}
inline int64_t decode_key(const rocksdb::Slice& key) {
  uint64_t u = 0;
  for (int b = 0; b < 8; ++b) u = (u << 8) | static_cast<uint8_t>(key.data()[b]);
  return static_cast<int64_t>(u ^ kSignBit);
}

std::string int64_bytes(int64_t v) { return std::string(reinterpret_cast<const char*>(&v), sizeof(v)); }

// The ids of a batch in key order: their encoded keys (8 bytes each, sorted) and, for
// each sorted position, the id's position in the batch.
struct SortedKeys {
  std::vector<char> bytes;     // (n * 8)
  std::vector<int64_t> order;  // (n,) batch position of the i-th smallest id
  std::vector<rocksdb::Slice> slices;
};

SortedKeys sort_keys(const Tensor& ids, bool dedupe) {
  const int64_t n = ids.numel();
  const int64_t* p = ids.data_ptr<int64_t>();
  SortedKeys s;
  s.order.resize(n);
  for (int64_t i = 0; i < n; ++i) s.order[i] = i;
  std::sort(s.order.begin(), s.order.end(), [p](int64_t a, int64_t b) { return order_of(p[a]) < order_of(p[b]); });
  if (dedupe) {
    s.order.erase(std::unique(s.order.begin(), s.order.end(), [p](int64_t a, int64_t b) { return p[a] == p[b]; }),
                  s.order.end());
  } else {
    for (size_t i = 1; i < s.order.size(); ++i) {
      TORCH_CHECK_VALUE(p[s.order[i]] != p[s.order[i - 1]], "ids must be distinct, got ", p[s.order[i]],
                        " more than once");
    }
  }
  const size_t m = s.order.size();
  s.bytes.resize(m * 8);
  s.slices.reserve(m);
  for (size_t i = 0; i < m; ++i) {
    encode_key(p[s.order[i]], s.bytes.data() + 8 * i);
    s.slices.emplace_back(s.bytes.data() + 8 * i, 8);
  }
  return s;
}

class Store : public torch::CustomClassHolder {
 public:
  Store(const std::string& path, int64_t dim, int64_t state_dim, const std::string& dtype,
        const std::string& state_dtype, int64_t block_cache_bytes, int64_t write_buffer_bytes, bool sync)
      : path_(path), dim_(dim), state_dim_(state_dim), dtype_name_(dtype), state_dtype_name_(state_dtype) {
    TORCH_CHECK_VALUE(dim >= 1, "dim must be >= 1, got ", dim);
    TORCH_CHECK_VALUE(state_dim >= 0, "state_dim must be >= 0, got ", state_dim);
    TORCH_CHECK_VALUE(block_cache_bytes >= 0, "block_cache_bytes must be >= 0, got ", block_cache_bytes);
    TORCH_CHECK_VALUE(write_buffer_bytes >= (1 << 20), "write_buffer_bytes must be >= 1 MiB, got ",
                      write_buffer_bytes);
    dtype_ = dtype_from_name(dtype, "dtype");
    state_dtype_ = dtype_from_name(state_dtype, "state_dtype");
    row_bytes_ = dim_ * static_cast<int64_t>(c10::elementSize(dtype_));
    state_bytes_ = state_dim_ * static_cast<int64_t>(c10::elementSize(state_dtype_));
    value_bytes_ = row_bytes_ + state_bytes_ + 8;
    write_options_.sync = sync;
    open(block_cache_bytes, write_buffer_bytes);
  }

  ~Store() override { close(); }

  int64_t size() {
    std::shared_lock<std::shared_mutex> lock(mu_);
    require_open();
    return count_;
  }

  // found (N,) bool, weights (N, dim), state (N, state_dim), scores (N,); zeros where absent.
  Entries get(const Tensor& ids) {
    std::shared_lock<std::shared_mutex> lock(mu_);
    require_open();
    check_ids(ids);
    SortedKeys keys = sort_keys(ids, /*dedupe=*/false);
    return read(keys, ids.numel(), nullptr);
  }

  Entries take(const Tensor& ids) {
    std::unique_lock<std::shared_mutex> lock(mu_);
    require_open();
    check_ids(ids);
    SortedKeys keys = sort_keys(ids, /*dedupe=*/false);
    std::vector<char> held;
    Entries out = read(keys, ids.numel(), &held);
    rocksdb::WriteBatch batch;
    int64_t removed = 0;
    for (size_t i = 0; i < keys.slices.size(); ++i) {
      if (!held[i]) continue;
      check(batch.Delete(rows_, keys.slices[i]), "take");
      ++removed;
    }
    if (removed > 0) commit(batch, count_ - removed, "take");
    return out;
  }

  void put(const Tensor& ids, const Tensor& weights, const Tensor& state, const Tensor& scores, bool fresh) {
    std::unique_lock<std::shared_mutex> lock(mu_);
    require_open();
    check_ids(ids);
    const int64_t n = ids.numel();
    check_tensor(weights, "weights", dtype_, {n, dim_});
    check_tensor(state, "optimizer_state", state_dtype_, {n, state_dim_});
    check_tensor(scores, "scores", at::kLong, {n});
    if (n == 0) return;
    SortedKeys keys = sort_keys(ids, /*dedupe=*/false);
    int64_t added = n;
    if (!fresh) {
      std::vector<char> held = exists(keys);
      for (char h : held) added -= h;
    }
    const Tensor w = weights.contiguous(), s = state.contiguous(), sc = scores.contiguous();
    const char* wp = static_cast<const char*>(w.data_ptr());
    const char* sp = static_cast<const char*>(s.data_ptr());
    const int64_t* scp = sc.data_ptr<int64_t>();
    rocksdb::WriteBatch batch(static_cast<size_t>(n) * (value_bytes_ + 24) + 64);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t r = keys.order[i];
      const int64_t score = scp[r];  // little-endian on every platform torch runs on
      rocksdb::Slice parts[3] = {{wp + r * row_bytes_, static_cast<size_t>(row_bytes_)},
                                 {sp + r * state_bytes_, static_cast<size_t>(state_bytes_)},
                                 {reinterpret_cast<const char*>(&score), 8}};
      check(batch.Put(rows_, rocksdb::SliceParts(&keys.slices[i], 1), rocksdb::SliceParts(parts, 3)), "put");
    }
    commit(batch, count_ + added, "put");
  }

  int64_t erase(const Tensor& ids) {
    std::unique_lock<std::shared_mutex> lock(mu_);
    require_open();
    check_ids(ids);
    SortedKeys keys = sort_keys(ids, /*dedupe=*/true);
    std::vector<char> held = exists(keys);
    rocksdb::WriteBatch batch;
    int64_t removed = 0;
    for (size_t i = 0; i < keys.slices.size(); ++i) {
      if (!held[i]) continue;
      check(batch.Delete(rows_, keys.slices[i]), "erase");
      ++removed;
    }
    if (removed > 0) commit(batch, count_ - removed, "erase");
    return removed;
  }

  // The ids of the n lowest (score, id) pairs, in that order: one scan with a max-heap of n.
  Tensor lowest(int64_t n) {
    std::shared_lock<std::shared_mutex> lock(mu_);
    require_open();
    TORCH_CHECK_VALUE(n >= 0, "n must be >= 0, got ", n);
    std::priority_queue<std::pair<int64_t, int64_t>> heap;  // (score, id), the largest on top
    if (n > 0) {
      std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(scan_options(), rows_));
      for (it->SeekToFirst(); it->Valid(); it->Next()) {
        const rocksdb::Slice v = it->value();
        check_value(v, it->key());
        int64_t score;
        std::memcpy(&score, v.data() + row_bytes_ + state_bytes_, 8);
        std::pair<int64_t, int64_t> e{score, decode_key(it->key())};
        if (static_cast<int64_t>(heap.size()) < n) {
          heap.push(e);
        } else if (e < heap.top()) {
          heap.pop();
          heap.push(e);
        }
      }
      check(it->status(), "lowest");
    }
    Tensor out = at::empty({static_cast<int64_t>(heap.size())}, at::kLong);
    int64_t* o = out.data_ptr<int64_t>();
    for (int64_t i = static_cast<int64_t>(heap.size()) - 1; i >= 0; --i, heap.pop()) o[i] = heap.top().second;
    return out;
  }

  // At most `rows` entries in id order, from the first id greater than `after` (from the
  // first id when has_after is false): keys, weights, state, scores.
  Entries chunk(int64_t after, bool has_after, int64_t rows) {
    std::shared_lock<std::shared_mutex> lock(mu_);
    require_open();
    TORCH_CHECK_VALUE(rows >= 1, "rows must be >= 1, got ", rows);
    std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(scan_options(), rows_));
    char start[8];
    if (has_after) {
      encode_key(after, start);
      it->Seek(rocksdb::Slice(start, 8));
      if (it->Valid() && it->key() == rocksdb::Slice(start, 8)) it->Next();
    } else {
      it->SeekToFirst();
    }
    const int64_t cap = std::min<int64_t>(rows, std::max<int64_t>(count_, 0));
    Tensor keys = at::empty({cap}, at::kLong), w = at::empty({cap, dim_}, dtype_),
           s = at::empty({cap, state_dim_}, state_dtype_), sc = at::empty({cap}, at::kLong);
    int64_t m = 0;
    for (; it->Valid() && m < cap; it->Next(), ++m) {
      const rocksdb::Slice v = it->value();
      check_value(v, it->key());
      keys.data_ptr<int64_t>()[m] = decode_key(it->key());
      unpack(v, m, w, s, sc);
    }
    check(it->status(), "chunks");
    if (m < cap) return {keys.narrow(0, 0, m), w.narrow(0, 0, m), s.narrow(0, 0, m), sc.narrow(0, 0, m)};
    return {keys, w, s, sc};
  }

  void clear() {
    std::unique_lock<std::shared_mutex> lock(mu_);
    require_open();
    rocksdb::WriteBatch batch;
    // Every key is 8 bytes, so 9 bytes of 0xff end a range holding all of them.
    check(batch.DeleteRange(rows_, rocksdb::Slice("", 0), rocksdb::Slice("\xff\xff\xff\xff\xff\xff\xff\xff\xff", 9)),
          "clear");
    commit(batch, 0, "clear");
    compact_locked();
  }

  // Syncs the write-ahead log: every write so far survives a power loss.
  void flush() {
    std::unique_lock<std::shared_mutex> lock(mu_);
    require_open();
    check(db_->FlushWAL(/*sync=*/true), "flush");
  }

  // Flushes the memtables and compacts every level: the files then hold only live entries.
  void compact() {
    std::unique_lock<std::shared_mutex> lock(mu_);
    require_open();
    compact_locked();
  }

  void close() {
    std::unique_lock<std::shared_mutex> lock(mu_);
    if (!db_) return;
    for (auto* handle : {rows_, meta_}) {
      if (handle != nullptr) db_->DestroyColumnFamilyHandle(handle);
    }
    rows_ = meta_ = nullptr;
    db_->Close();
    db_.reset();
  }

  c10::Dict<std::string, int64_t> stats() {
    std::shared_lock<std::shared_mutex> lock(mu_);
    require_open();
    c10::Dict<std::string, int64_t> out;
    uint64_t v = 0;
    out.insert("entries", count_);
    db_->GetIntProperty(rows_, "rocksdb.total-sst-files-size", &v);
    out.insert("disk_bytes", static_cast<int64_t>(v));
    db_->GetIntProperty(rows_, "rocksdb.cur-size-all-mem-tables", &v);
    out.insert("memtable_bytes", static_cast<int64_t>(v));
    out.insert("block_cache_bytes", static_cast<int64_t>(cache_ ? cache_->GetUsage() : 0));
    return out;
  }

  std::string layout() const { return layout_text(); }

 private:
  std::string layout_text() const {
    return "veloce-rocksdb format=" + std::to_string(kFormatVersion) + " dim=" + std::to_string(dim_) +
           " state_dim=" + std::to_string(state_dim_) + " dtype=" + dtype_name_ + " state_dtype=" + state_dtype_name_;
  }

  void open(int64_t block_cache_bytes, int64_t write_buffer_bytes) {
    rocksdb::Options options;
    options.create_if_missing = true;
    options.create_missing_column_families = true;
    options.max_background_jobs = 2;
    // Table files are read through mmap: an entry in the page cache is then read without a
    // system call (about 1.5-2x the rows/s of pread for random batches of hits).
    options.allow_mmap_reads = true;
    // Every batch also writes the count in "veloce_meta", whose memtable never fills: a
    // log file is kept until every family's memtable holding its records is flushed, so
    // without this bound the logs would grow until 4x the write buffers.
    options.max_total_wal_size = 2 * static_cast<uint64_t>(write_buffer_bytes);
    // A torn last record (a crash or a full disk mid-write) is dropped on recovery: the
    // database reopens with every write that completed before it.
    options.wal_recovery_mode = rocksdb::WALRecoveryMode::kPointInTimeRecovery;
    rocksdb::ColumnFamilyOptions rows_options;
    rocksdb::BlockBasedTableOptions table;
    if (block_cache_bytes > 0) {
      cache_ = rocksdb::NewLRUCache(static_cast<size_t>(block_cache_bytes));
      table.block_cache = cache_;
    } else {
      table.no_block_cache = true;
    }
    // Ids missing from the store (new ids, ids held by the cache above) are the common
    // lookup: a Bloom filter answers them without reading a block.
    table.filter_policy.reset(rocksdb::NewBloomFilterPolicy(10));
    // A read of one entry reads its whole block: small blocks keep that near the entry's size.
    table.block_size = 4 * 1024;
    rows_options.table_factory.reset(rocksdb::NewBlockBasedTableFactory(table));
    // Rows and optimizer state are float noise that compresses by a few percent at most:
    // compression would cost CPU on every read and write for nothing.
    rows_options.compression = rocksdb::kNoCompression;
    rows_options.bottommost_compression = rocksdb::kNoCompression;
    rows_options.write_buffer_size = static_cast<size_t>(write_buffer_bytes);
    rows_options.level_compaction_dynamic_level_bytes = true;
    std::vector<rocksdb::ColumnFamilyDescriptor> families = {
        {rocksdb::kDefaultColumnFamilyName, rows_options}, {kMetaFamily, rocksdb::ColumnFamilyOptions()}};
    std::vector<std::string> existing;
    if (rocksdb::DB::ListColumnFamilies(options, path_, &existing).ok()) {  // a database is there already
      std::sort(existing.begin(), existing.end());
      TORCH_CHECK(existing == std::vector<std::string>({rocksdb::kDefaultColumnFamilyName, kMetaFamily}),
                  "the RocksDB database at ", path_, " is not a veloce store (its column families are ",
                  c10::Join(", ", existing), "). Give this table another path.");
    }
    std::vector<rocksdb::ColumnFamilyHandle*> handles;
    rocksdb::DB* db = nullptr;
    rocksdb::Status st = rocksdb::DB::Open(options, path_, families, &handles, &db);
    if (!st.ok()) {
      const std::string msg = st.ToString();
      TORCH_CHECK(msg.find("lock") == std::string::npos && msg.find("LOCK") == std::string::npos,
                  "the RocksDB database at ", path_,
                  " is in use by another process (or by another store of this process): its LOCK file is held (",
                  msg, "). Close the store that holds it, or give this table another path.");
      TORCH_CHECK(false, "could not open the RocksDB database at ", path_, ": ", msg);
    }
    db_.reset(db);
    rows_ = handles[0];
    meta_ = handles[1];
    try {
      check_layout();
    } catch (...) {
      close();
      throw;
    }
  }

  void check_layout() {
    std::string stored, count;
    rocksdb::Status st = db_->Get(rocksdb::ReadOptions(), meta_, kLayoutKey, &stored);
    if (st.IsNotFound()) {
      std::unique_ptr<rocksdb::Iterator> it(db_->NewIterator(rocksdb::ReadOptions(), rows_));
      it->SeekToFirst();
      TORCH_CHECK(!it->Valid(), "the RocksDB database at ", path_,
                  " holds records but no veloce layout: it is not a veloce store. Give this table another path.");
      rocksdb::WriteBatch batch;
      check(batch.Put(meta_, kLayoutKey, layout_text()), "create");
      check(batch.Put(meta_, kCountKey, int64_bytes(0)), "create");
      rocksdb::WriteOptions durable;
      durable.sync = true;
      check(db_->Write(durable, &batch), "create");
      count_ = 0;
      return;
    }
    check(st, "open");
    TORCH_CHECK_VALUE(stored == layout_text(), "the RocksDB database at ", path_,
                      " was written by another table layout: it holds [", stored, "] but this table is [",
                      layout_text(), "]. Open it with the layout it was written with, or give this table another path.");
    check(db_->Get(rocksdb::ReadOptions(), meta_, kCountKey, &count), "open");
    TORCH_CHECK(count.size() == 8, "the RocksDB database at ", path_, " has a corrupt count record (", count.size(),
                " bytes, expected 8)");
    std::memcpy(&count_, count.data(), 8);
  }

  void require_open() const {
    TORCH_CHECK(db_ != nullptr, "the RocksDB store at ", path_, " is closed; open a new one to use it");
  }

  void check(const rocksdb::Status& st, const char* what) const {
    TORCH_CHECK(st.ok(), "RocksDB ", what, " at ", path_, " failed: ", st.ToString());
  }

  // Writes `batch` with the count record set to `count`, all or nothing.
  void commit(rocksdb::WriteBatch& batch, int64_t count, const char* what) {
    check(batch.Put(meta_, kCountKey, int64_bytes(count)), what);
    rocksdb::Status st = db_->Write(write_options_, &batch);
    TORCH_CHECK(st.ok(), "RocksDB ", what, " at ", path_, " failed and wrote none of its ", batch.Count() - 1,
                " records: ", st.ToString(),
                ". An IO error here is most often a full disk or a file size limit: the database keeps every "
                "batch written before this one; free space, then reopen the store.");
    count_ = count;
  }

  void compact_locked() {
    check(db_->Flush(rocksdb::FlushOptions(), {rows_, meta_}), "compact");  // frees every log file
    rocksdb::CompactRangeOptions options;
    options.bottommost_level_compaction = rocksdb::BottommostLevelCompaction::kForce;
    check(db_->CompactRange(options, rows_, nullptr, nullptr), "compact");
  }

  rocksdb::ReadOptions scan_options() const {
    rocksdb::ReadOptions options;
    options.fill_cache = false;  // a full scan would evict every hot block
    options.readahead_size = 2 << 20;
    return options;
  }

  void check_ids(const Tensor& ids) const {
    TORCH_CHECK_VALUE(ids.device().is_cpu(), "ids must be on the CPU, got ", ids.device());
    TORCH_CHECK_VALUE(ids.scalar_type() == at::kLong, "ids must be int64, got ", ids.scalar_type());
    TORCH_CHECK_VALUE(ids.dim() == 1 && ids.is_contiguous(), "ids must be a contiguous 1-D tensor, got shape ",
                      ids.sizes());
  }

  void check_tensor(const Tensor& t, const char* name, at::ScalarType dtype, at::IntArrayRef shape) const {
    TORCH_CHECK_VALUE(t.device().is_cpu(), name, " must be on the CPU, got ", t.device());
    TORCH_CHECK_VALUE(t.scalar_type() == dtype, name, " must be ", dtype, " (the store's layout), got ",
                      t.scalar_type());
    TORCH_CHECK_VALUE(t.sizes() == shape, name, " must have shape ", shape, ", got ", t.sizes());
  }

  void check_value(const rocksdb::Slice& v, const rocksdb::Slice& key) const {
    TORCH_CHECK(static_cast<int64_t>(v.size()) == value_bytes_ && key.size() == 8, "the RocksDB database at ", path_,
                " holds a record of ", key.size(), "+", v.size(), " bytes where its layout says 8+", value_bytes_,
                ": it is corrupt");
  }

  void unpack(const rocksdb::Slice& v, int64_t r, Tensor& w, Tensor& s, Tensor& sc) const {
    std::memcpy(static_cast<char*>(w.data_ptr()) + r * row_bytes_, v.data(), row_bytes_);
    std::memcpy(static_cast<char*>(s.data_ptr()) + r * state_bytes_, v.data() + row_bytes_, state_bytes_);
    std::memcpy(sc.data_ptr<int64_t>() + r, v.data() + row_bytes_ + state_bytes_, 8);
  }

  // Reads the entries of the sorted `keys` into batch order; `held` (if given) gets, per
  // sorted position, whether the id is held.
  Entries read(const SortedKeys& keys, int64_t n, std::vector<char>* held) const {
    Tensor found = at::zeros({n}, at::kBool), w = at::empty({n, dim_}, dtype_),
           s = at::empty({n, state_dim_}, state_dtype_), sc = at::empty({n}, at::kLong);
    bool* f = found.data_ptr<bool>();
    if (held) held->assign(keys.slices.size(), 0);
    multi_get(keys, [&](int64_t i, const rocksdb::PinnableSlice* value) {
      const int64_t r = keys.order[i];
      if (value == nullptr) {
        std::memset(static_cast<char*>(w.data_ptr()) + r * row_bytes_, 0, row_bytes_);
        std::memset(static_cast<char*>(s.data_ptr()) + r * state_bytes_, 0, state_bytes_);
        sc.data_ptr<int64_t>()[r] = 0;
        return;
      }
      check_value(*value, keys.slices[i]);
      unpack(*value, r, w, s, sc);
      f[r] = true;
      if (held) (*held)[i] = 1;
    });
    return {found, w, s, sc};
  }

  // Per sorted position, whether the id is held.
  std::vector<char> exists(const SortedKeys& keys) const {
    std::vector<char> held(keys.slices.size(), 0);
    multi_get(keys, [&](int64_t i, const rocksdb::PinnableSlice* value) { held[i] = value != nullptr; });
    return held;
  }

  // Calls visit(i, value) for each sorted position i, value nullptr where the id is absent:
  // one sorted MultiGet per kGetGrain ids, the chunks over torch's intra-op threads.
  template <typename Visit>
  void multi_get(const SortedKeys& keys, const Visit& visit) const {
    const int64_t m = static_cast<int64_t>(keys.slices.size());
    at::parallel_for(0, m, kGetGrain, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; b += kGetGrain) {
        const int64_t e = std::min(end, b + kGetGrain);
        std::vector<rocksdb::PinnableSlice> values(e - b);
        std::vector<rocksdb::Status> statuses(e - b);
        db_->MultiGet(rocksdb::ReadOptions(), rows_, e - b, keys.slices.data() + b, values.data(), statuses.data(),
                      /*sorted_input=*/true);
        for (int64_t i = b; i < e; ++i) {
          const rocksdb::Status& st = statuses[i - b];
          if (!st.IsNotFound()) check(st, "read");
          visit(i, st.IsNotFound() ? nullptr : &values[i - b]);
        }
      }
    });
  }

  std::string path_;
  int64_t dim_, state_dim_;
  std::string dtype_name_, state_dtype_name_;
  at::ScalarType dtype_, state_dtype_;
  int64_t row_bytes_ = 0, state_bytes_ = 0, value_bytes_ = 0;
  int64_t count_ = 0;
  rocksdb::WriteOptions write_options_;
  std::shared_ptr<rocksdb::Cache> cache_;
  std::unique_ptr<rocksdb::DB> db_;
  rocksdb::ColumnFamilyHandle* rows_ = nullptr;
  rocksdb::ColumnFamilyHandle* meta_ = nullptr;
  mutable std::shared_mutex mu_;
};

}  // namespace
}  // namespace veloce

TORCH_LIBRARY(veloce_rocksdb, m) {
  m.class_<veloce::Store>("Store")
      .def(torch::init<std::string, int64_t, int64_t, std::string, std::string, int64_t, int64_t, bool>())
      .def("size", &veloce::Store::size)
      .def("get", &veloce::Store::get)
      .def("take", &veloce::Store::take)
      .def("put", &veloce::Store::put)
      .def("erase", &veloce::Store::erase)
      .def("lowest", &veloce::Store::lowest)
      .def("chunk", &veloce::Store::chunk)
      .def("clear", &veloce::Store::clear)
      .def("flush", &veloce::Store::flush)
      .def("compact", &veloce::Store::compact)
      .def("close", &veloce::Store::close)
      .def("stats", &veloce::Store::stats)
      .def("layout", &veloce::Store::layout);
}
