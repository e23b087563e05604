//go:build !unix

package testserver

import (
	"os"
	"syscall"
)

func newProcAttr() *syscall.SysProcAttr { return nil }

// terminate has no graceful signal to send outside unix.
func terminate(p *os.Process) { _ = p.Kill() }

func kill(p *os.Process) { _ = p.Kill() }
