package bench

import (
	"bufio"
	"fmt"
	"os"
	"strconv"
	"strings"
)

// clockTicks is USER_HZ, the unit of the times in /proc; 100 on every Linux
// architecture Go runs on here.
const clockTicks = 100

// ProcCPU returns a process's user+system CPU seconds from /proc/<pid>/stat.
func ProcCPU(pid int) (float64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	return parseStatCPU(string(b))
}

// parseStatCPU reads utime and stime (fields 14 and 15) from a stat line.
func parseStatCPU(s string) (float64, error) {
	st, err := parseStat(s)
	return st.cpu, err
}

// procStat is what the benchmark reads from a /proc/<pid>/stat line.
type procStat struct {
	ppid     int
	cpu      float64 // utime + stime, seconds
	children float64 // cutime + cstime: children it has waited for, seconds
}

// parseStat reads ppid (field 4), utime, stime, cutime and cstime (fields
// 14-17) from a stat line. The command name (field 2) may hold spaces and
// parentheses, so fields are counted from the last ')'.
func parseStat(s string) (procStat, error) {
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return procStat{}, fmt.Errorf("parse /proc stat: no ')' in %q", s)
	}
	f := strings.Fields(s[i+1:])
	// f[0] is field 3 (state), so field n is f[n-3].
	if len(f) < 15 {
		return procStat{}, fmt.Errorf("parse /proc stat: %d fields after the name", len(f))
	}
	var v [5]uint64
	for k, n := range []int{4, 14, 15, 16, 17} {
		x, err := strconv.ParseUint(f[n-3], 10, 64)
		if err != nil {
			return procStat{}, fmt.Errorf("parse /proc stat: field %d %q", n, f[n-3])
		}
		v[k] = x
	}
	return procStat{ppid: int(v[0]), cpu: float64(v[1]+v[2]) / clockTicks, children: float64(v[3]+v[4]) / clockTicks}, nil
}

// ServerCPU returns the CPU seconds of a PostgreSQL server: the postmaster,
// every live child (backends, walsenders, checkpointer, autovacuum...) and
// every child that has exited (the postmaster waits for each, so their time
// is in its cutime and cstime). The difference over an interval is
// therefore exact for backends that come and go within it, as the
// producers' connections and the relay's do, which a sum of live children
// alone would miss.
func ServerCPU(postmaster int) (float64, error) {
	// Children first: one exiting between the two reads is counted twice
	// rather than not at all (a tick or two, against seconds).
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return 0, err
	}
	var total float64
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == postmaster {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue // exited
		}
		if st, err := parseStat(string(b)); err == nil && st.ppid == postmaster {
			total += st.cpu
		}
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", postmaster))
	if err != nil {
		return 0, err
	}
	st, err := parseStat(string(b))
	if err != nil {
		return 0, err
	}
	return total + st.cpu + st.children, nil
}

// ProcPeakRSS returns VmHWM, the process's peak resident set, in MiB.
func ProcPeakRSS(pid int) (float64, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Text()
		if v, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			kb, err := strconv.ParseFloat(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 64)
			if err != nil {
				return 0, fmt.Errorf("parse VmHWM %q: %w", v, err)
			}
			return kb / 1024, nil
		}
	}
	return 0, fmt.Errorf("no VmHWM in /proc/%d/status", pid)
}

// MachineBusy returns the busy CPU seconds of all cores since boot (every
// /proc/stat cpu field but idle and iowait).
func MachineBusy() (float64, error) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, err
	}
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line)
	if len(f) < 5 || f[0] != "cpu" {
		return 0, fmt.Errorf("parse /proc/stat: %q", line)
	}
	var busy uint64
	for i, v := range f[1:] {
		if i == 3 || i == 4 { // idle, iowait
			continue
		}
		if i >= 8 { // guest time is already counted in user
			break
		}
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			return 0, fmt.Errorf("parse /proc/stat: %q", line)
		}
		busy += n
	}
	return float64(busy) / clockTicks, nil
}

// cpuMeter reads a CPU counter at the start of an interval and reports the
// difference; a process that is gone reads as its last value.
type cpuMeter struct {
	read  func() (float64, error)
	start float64
	last  float64
}

func newCPUMeter(read func() (float64, error)) *cpuMeter {
	m := &cpuMeter{read: read}
	if v, err := read(); err == nil {
		m.start, m.last = v, v
	}
	return m
}

func (m *cpuMeter) delta() float64 {
	if v, err := m.read(); err == nil {
		m.last = v
	}
	return m.last - m.start
}

func pidCPU(pid int) func() (float64, error) {
	return func() (float64, error) { return ProcCPU(pid) }
}

// ProcSwitches returns the context switches of every live thread of pid
// (voluntary plus involuntary: a goroutine hand-off that parks or wakes a
// thread is one) and its read and write system calls (/proc/<pid>/io).
// Per message they show where CPU time goes that an instruction count
// misses: the kernel's part of waking threads and moving bytes.
func ProcSwitches(pid int) (switches, syscalls float64, err error) {
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil {
		return 0, 0, err
	}
	for _, t := range tasks {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/status", pid, t.Name()))
		if err != nil {
			continue // the thread exited
		}
		for _, line := range strings.Split(string(b), "\n") {
			if k, v, ok := strings.Cut(line, ":"); ok && strings.HasSuffix(k, "ctxt_switches") {
				n, _ := strconv.ParseFloat(strings.TrimSpace(v), 64)
				switches += n
			}
		}
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/io", pid))
	if err != nil {
		return switches, 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(line, ":"); ok && (k == "syscr" || k == "syscw") {
			n, _ := strconv.ParseFloat(strings.TrimSpace(v), 64)
			syscalls += n
		}
	}
	return switches, syscalls, nil
}
