// nvmeswap's asynchronous file I/O engine: a pool of threads issuing pread/pwrite on files opened
// with O_DIRECT, several requests (split into blocks) in flight at once, every completion checked.
//
// Python sees one class, Engine(threads, block_size), with
//   submit(kind, buffer, path, offset)  kind 'r' or 'w'; buffer a contiguous CPU tensor
//   wait()                              block until every submitted request is done; raises
//                                       RuntimeError naming the file and offset of the first failure
//   pending()                           requests not finished yet
// and a function checksum(tensor) -> int (64-bit, order-sensitive hash of the bytes).
#include <torch/extension.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr uint64_t kAlign = 4096;

struct Request {
  char kind = 'r';
  std::string path;
  int fd = -1;
  bool direct = false;
  std::atomic<int64_t> blocks_left{0};
  std::mutex err_mu;
  std::string error;  // first failure of this request
  ~Request() {
    if (fd >= 0) ::close(fd);
  }
};

struct Block {
  std::shared_ptr<Request> req;
  char* ptr = nullptr;
  uint64_t nbytes = 0;
  uint64_t offset = 0;
};

class Engine {
 public:
  Engine(int64_t threads, int64_t block_size) : block_size_(static_cast<uint64_t>(block_size)) {
    TORCH_CHECK(threads >= 1, "nvmeswap I/O engine: threads must be >= 1, got ", threads);
    TORCH_CHECK(block_size >= static_cast<int64_t>(kAlign) && block_size % kAlign == 0,
                "nvmeswap I/O engine: block_size must be a positive multiple of 4096, got ", block_size);
    for (int64_t i = 0; i < threads; ++i) workers_.emplace_back([this] { loop(); });
  }

  ~Engine() {
    {
      std::lock_guard<std::mutex> g(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }

  // Returns true when the file was opened with O_DIRECT.
  bool submit(const std::string& kind, const torch::Tensor& buf, const std::string& path, int64_t offset) {
    TORCH_CHECK(kind == "r" || kind == "w", "nvmeswap I/O engine: kind must be 'r' or 'w', got '", kind, "'");
    TORCH_CHECK(buf.device().is_cpu() && buf.is_contiguous(),
                "nvmeswap I/O engine: the buffer must be a contiguous CPU tensor");
    TORCH_CHECK(offset >= 0, "nvmeswap I/O engine: negative file offset ", offset);
    char* ptr = static_cast<char*>(buf.data_ptr());
    uint64_t nbytes = static_cast<uint64_t>(buf.numel()) * buf.element_size();
    auto req = std::make_shared<Request>();
    req->kind = kind[0];
    req->path = path;
    bool aligned = (reinterpret_cast<uintptr_t>(ptr) % kAlign == 0) && (nbytes % kAlign == 0) &&
                   (static_cast<uint64_t>(offset) % kAlign == 0);
    // never through a symbolic link planted at the path (O_NOFOLLOW: ELOOP instead)
    int flags = (req->kind == 'r' ? O_RDONLY : (O_WRONLY | O_CREAT)) | O_NOFOLLOW | O_CLOEXEC;
    int fd = -1;
    if (aligned) {
      fd = ::open(path.c_str(), flags | O_DIRECT, 0600);
      req->direct = fd >= 0;
    }
    if (fd < 0) fd = ::open(path.c_str(), flags, 0600);  // unaligned, or a filesystem without O_DIRECT
    if (fd < 0) {
      int e = errno;
      std::string why = e == ELOOP ? "it is a symbolic link, and nvmeswap never follows links in its swap folder"
                                   : std::strerror(e);
      throw std::runtime_error("nvmeswap: cannot open '" + path + "' for " +
                               (req->kind == 'r' ? "reading" : "writing") + ": " + why);
    }
    req->fd = fd;
    uint64_t nblocks = nbytes == 0 ? 0 : (nbytes + block_size_ - 1) / block_size_;
    req->blocks_left = static_cast<int64_t>(nblocks);
    if (nblocks == 0) return req->direct;
    {
      std::lock_guard<std::mutex> g(mu_);
      ++inflight_;
      for (uint64_t b = 0; b < nblocks; ++b) {
        uint64_t start = b * block_size_;
        uint64_t n = std::min<uint64_t>(block_size_, nbytes - start);
        queue_.push_back(Block{req, ptr + start, n, static_cast<uint64_t>(offset) + start});
      }
    }
    cv_.notify_all();
    return req->direct;
  }

  void wait() {
    std::unique_lock<std::mutex> g(mu_);
    done_cv_.wait(g, [this] { return inflight_ == 0; });
    if (!errors_.empty()) {
      std::ostringstream os;
      os << errors_.front();
      if (errors_.size() > 1) os << " (and " << errors_.size() - 1 << " more failed request(s))";
      errors_.clear();
      throw std::runtime_error(os.str());
    }
  }

  int64_t pending() {
    std::lock_guard<std::mutex> g(mu_);
    return inflight_;
  }

 private:
  static void fail(Request& r, uint64_t offset, uint64_t want, uint64_t got, int err) {
    std::lock_guard<std::mutex> g(r.err_mu);
    if (!r.error.empty()) return;
    std::ostringstream os;
    const char* what = r.kind == 'r' ? "read" : "write";
    os << "nvmeswap: " << what << " of '" << r.path << "' at offset " << offset << " failed after " << got
       << " of " << want << " bytes: ";
    if (err != 0)
      os << std::strerror(err) << " (errno " << err << ")";
    else
      os << "short " << what << " (end of file or no progress)";
    r.error = os.str();
  }

  void run(Block& b) {
    Request& r = *b.req;
    uint64_t done = 0;
    while (done < b.nbytes) {
      ssize_t n = r.kind == 'r' ? ::pread(r.fd, b.ptr + done, b.nbytes - done, b.offset + done)
                                : ::pwrite(r.fd, b.ptr + done, b.nbytes - done, b.offset + done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {  // an error, or a read at end of file: never silently short
        fail(r, b.offset + done, b.nbytes, done, n < 0 ? errno : 0);
        return;
      }
      done += static_cast<uint64_t>(n);
    }
  }

  void loop() {
    for (;;) {
      Block b;
      {
        std::unique_lock<std::mutex> g(mu_);
        cv_.wait(g, [this] { return stop_ || !queue_.empty(); });
        if (stop_ && queue_.empty()) return;
        b = std::move(queue_.front());
        queue_.pop_front();
      }
      run(b);
      if (--b.req->blocks_left == 0) {
        std::string err;
        {
          std::lock_guard<std::mutex> eg(b.req->err_mu);
          err = b.req->error;
        }
        // close the file once its last block is done; on network filesystems (NFS) a write
        // error can surface only here, so a write whose close fails is a failed write (EINTR
        // is not: Linux closes the descriptor anyway and the data was handed over)
        const int fd = b.req->fd;
        b.req->fd = -1;
        if (fd >= 0 && ::close(fd) != 0 && errno != EINTR && b.req->kind == 'w' && err.empty()) {
          const int e = errno;
          err = "nvmeswap: closing '" + b.req->path + "' after writing failed: " + std::strerror(e) + " (errno " +
                std::to_string(e) + ")";
        }
        b.req.reset();
        std::lock_guard<std::mutex> g(mu_);
        if (!err.empty()) errors_.push_back(err);
        --inflight_;
        if (inflight_ == 0) done_cv_.notify_all();
      }
    }
  }

  uint64_t block_size_;
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  std::deque<Block> queue_;
  std::vector<std::string> errors_;
  int64_t inflight_ = 0;
  bool stop_ = false;
};

// A 64-bit hash of the bytes: four independent lanes over 8-byte words (several GB/s on one
// core), then the tail byte by byte; position-sensitive, so a flipped, swapped or shifted byte
// changes it.  Not cryptographic.  tests/test_nvmeswap_io.py holds the same function in Python.
uint64_t checksum(const torch::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "nvmeswap checksum: need a contiguous CPU tensor");
  const unsigned char* p = static_cast<const unsigned char*>(t.data_ptr());
  uint64_t n = static_cast<uint64_t>(t.numel()) * t.element_size();
  const uint64_t P1 = 0x9E3779B185EBCA87ULL, P2 = 0xC2B2AE3D27D4EB4FULL;
  uint64_t h[4] = {P1, P2, P1 ^ P2, ~P1};
  uint64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    for (int k = 0; k < 4; ++k) {
      uint64_t w;
      std::memcpy(&w, p + i + 8 * k, 8);
      h[k] ^= w * P2;
      h[k] = ((h[k] << 31) | (h[k] >> 33)) * P1;
    }
  }
  uint64_t acc = n * P1;
  for (int k = 0; k < 4; ++k) acc = (acc ^ h[k]) * P2 + (acc >> 29);
  for (; i < n; ++i) acc = (acc ^ p[i]) * P1;
  acc ^= acc >> 33;
  acc *= P2;
  acc ^= acc >> 29;
  return acc;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Engine>(m, "Engine")
      .def(py::init<int64_t, int64_t>(), py::arg("threads"), py::arg("block_size"))
      .def("submit", &Engine::submit, py::arg("kind"), py::arg("buffer"), py::arg("path"), py::arg("offset"),
           py::call_guard<py::gil_scoped_release>())
      .def("wait", &Engine::wait, py::call_guard<py::gil_scoped_release>())
      .def("pending", &Engine::pending);
  m.def("checksum", &checksum, py::arg("tensor"), py::call_guard<py::gil_scoped_release>());
}
