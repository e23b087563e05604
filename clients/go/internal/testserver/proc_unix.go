//go:build unix

package testserver

import (
	"os"
	"syscall"
)

// newProcAttr puts the server in its own process group, so kill reaches the engine core process too.
func newProcAttr() *syscall.SysProcAttr { return &syscall.SysProcAttr{Setpgid: true} }

func terminate(p *os.Process) { _ = p.Signal(syscall.SIGTERM) }

func kill(p *os.Process) { _ = syscall.Kill(-p.Pid, syscall.SIGKILL) }
