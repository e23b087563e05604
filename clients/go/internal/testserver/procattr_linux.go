package testserver

import "syscall"

// newProcAttr puts the server in its own process group (so kill reaches the engine core process too) and
// has the kernel send it SIGTERM if the test process dies without stopping it (a panic, go test's timeout).
func newProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGTERM}
}
