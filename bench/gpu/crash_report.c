/* A native stack trace where a process dies of a signal, for GPU runs whose crashes happen in
 * C++ (Python's faulthandler shows only the Python frames). Preloaded by
 * bench/gpu/dropin_check.sh: LD_PRELOAD=crash_report.so. On SIGSEGV, SIGBUS, SIGFPE, SIGILL
 * or SIGABRT it writes to the stderr the process started with one "allocwatch crash report"
 * block: the signal, the faulting address and the frames as "library(symbol+offset) [address]"
 * (hidden symbols as "library(+offset)", which `addr2line -f -C -e library offset` resolves),
 * then lets the signal take its course: handlers installed later (Python's faulthandler) run
 * first and call this one after theirs. */
#define _GNU_SOURCE
#include <execinfo.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static const int kSignals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT};
static char alternate_stack[1 << 16];

/* The process's stderr as it was at start: pytest captures descriptor 2 into a file that dies
 * with the process, so the report goes where Python's faulthandler writes, the original. */
static int report_fd = STDERR_FILENO;

static void say(const char* text) {
  ssize_t ignored = write(report_fd, text, strlen(text));
  (void)ignored;
}

static void report(int signal_number, siginfo_t* info, void* context) {
  (void)context;
  char line[160];
  snprintf(line, sizeof line, "\n=== allocwatch crash report: signal %d (%s) at address %p, pid %d\n",
           signal_number, strsignal(signal_number), info ? info->si_addr : NULL, (int)getpid());
  say(line);
  void* frames[64];
  const int count = backtrace(frames, 64);
  backtrace_symbols_fd(frames, count, report_fd);
  say("=== end of crash report\n");
  signal(signal_number, SIG_DFL);
  raise(signal_number);
}

__attribute__((constructor)) static void install(void) {
  const int original = fcntl(STDERR_FILENO, F_DUPFD_CLOEXEC, 100);
  if (original >= 0) report_fd = original;
  void* warm[2];
  backtrace(warm, 2); /* loads the unwinder now, not inside the handler */
  stack_t stack = {.ss_sp = alternate_stack, .ss_size = sizeof alternate_stack, .ss_flags = 0};
  sigaltstack(&stack, NULL);
  struct sigaction action;
  memset(&action, 0, sizeof action);
  action.sa_sigaction = report;
  action.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&action.sa_mask);
  for (size_t i = 0; i < sizeof kSignals / sizeof kSignals[0]; ++i)
    sigaction(kSignals[i], &action, NULL);
}
