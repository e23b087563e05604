//go:build unix

package testserver

import (
	"os"
	"syscall"
)

func terminate(p *os.Process) { _ = p.Signal(syscall.SIGTERM) }

// kill reaches the whole process group: the server and its engine core process.
func kill(p *os.Process) { _ = syscall.Kill(-p.Pid, syscall.SIGKILL) }
